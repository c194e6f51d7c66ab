"""Who owns a received blob's memory, said explicitly.

- `get_blob` / `batch_get` return buffers the caller owns: nothing in the SDK touches them again.
- `lease` returns a `BlobLease`: blobs in the SDK's memory (a reused receive buffer, or the
  shared-memory segment of a same-host server) that stay valid until `release()` or the end of the
  `with` block, and are then reused. Copy what must outlive the lease (decoding does). On release the
  lease's memoryviews are released too, so a later use of one raises ValueError, and a view still
  exported (a `torch.frombuffer(view)` alive) keeps its memory out of reuse until the export is gone.
  What Python cannot see is the caller's to respect: a slice or `np.frombuffer` of a lent view is a
  new view of the same memory and must not outlive the lease.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvstore.blob import BlobHeader
from kvstore.protocol import Blob

Free = Callable[[], None]


class Loan:
    """Views of one piece of memory and how to give it back; `end()` is False while a view is exported."""

    __slots__ = ("views", "free")

    def __init__(self, views: list[memoryview], free: Free) -> None:
        self.views, self.free = views, free

    def end(self) -> bool:
        for view in self.views:
            try:
                view.release()
            except BufferError:
                return False
        self.free()
        return True


class LoanBook:
    """Loans that could not end at release time (a view still exported) are retried here later."""

    def __init__(self) -> None:
        self._stuck: list[Loan] = []
        self._lock = threading.Lock()

    def end(self, loan: Loan) -> None:
        if not loan.end():
            with self._lock:
                self._stuck.append(loan)

    def retry(self) -> None:
        if not self._stuck:
            return
        with self._lock:
            stuck, self._stuck = self._stuck, []
        for loan in stuck:
            self.end(loan)


class BlobLease:
    """Blobs lent by a backend until `release()`. `headers[i]` is the parsed header when this process
    verified blob i already (the in-process store does on every read); None means verify before use.

    An in-place lease (`lease(..., in_place=True)`) may hold blobs that the server can overwrite while
    they are out: use them, then `intact()` says which were whole all along; what was made of one that
    was not is to be thrown away (any other lease is intact throughout)."""

    def __init__(
        self,
        blobs: Sequence[Blob | None],
        headers: Sequence[BlobHeader | None] | None = None,
        on_release: Callable[[], None] | None = None,
        intact: Callable[[], list[bool]] | None = None,
    ) -> None:
        self.blobs = list(blobs)
        self.headers = list(headers) if headers is not None else [None] * len(self.blobs)
        self._on_release = on_release
        self._intact = intact

    def intact(self) -> list[bool]:
        """Per blob, whether it held the same bytes from the lease until now (ask after using them)."""
        return [True] * len(self.blobs) if self._intact is None else self._intact()

    def release(self) -> None:
        on_release, self._on_release = self._on_release, None
        self.blobs = [None] * len(self.blobs)
        if on_release is not None:
            on_release()

    def __len__(self) -> int:
        return len(self.blobs)

    def __iter__(self) -> Iterator[Blob | None]:
        return iter(self.blobs)

    def __getitem__(self, i: int) -> Blob | None:
        return self.blobs[i]

    def __enter__(self) -> BlobLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def fresh_buffer(n: int) -> memoryview:
    """A new buffer for a caller to own (not zeroed first: it is about to be filled)."""
    return memoryview(np.empty(n, np.uint8))


class BufferPool:
    """Receive buffers reused between leases (a fresh large buffer costs its page faults every time).
    A buffer goes back to the pool when its lease ends, never while lent. The one given back last is
    taken first: it is likely still in the CPU's caches (filling a cold 1 MiB buffer and reading it back
    costs ~2x a warm one here)."""

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._free: list[bytearray] = []
        self._held = 0  # bytes of the pooled buffers, lent or free
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple[memoryview, Free]:
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                buf = self._free[i]
                if n <= len(buf) <= 2 * n:
                    del self._free[i]
                    return memoryview(buf)[:n], lambda b=buf: self._give_back(b)
            pooled = self._held + n <= self.max_bytes
            if pooled:
                self._held += n
        buf = bytearray(n)
        return memoryview(buf)[:n], (lambda: self._give_back(buf)) if pooled else (lambda: None)

    def _give_back(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
