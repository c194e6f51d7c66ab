"""Same-host shared memory for the data plane: segments and the offsets inside them (docs/design.md §8).

The server owns every segment. A segment is a sealed memfd: it has no name anywhere (nothing in
/dev/shm to leak: it is freed when the last process holding it goes), it cannot be shrunk or grown (so
no peer can make the other side's mapping fault), and its pages are reserved up front with
`posix_fallocate` (a full tmpfs is an error at open, never a SIGBUS later). The client maps it through
`/proc/<server pid>/fd/<fd>` and proves it did by echoing the random nonce the server wrote into the
segment's first page; a client on another host, in another PID namespace or under another user cannot
open it or reads another nonce, and stays on TCP.

    SHM_OPEN   {"size": n}               -> {"seg": id, "path": "/proc/P/fd/F", "size": m, "nonce": b16}
    SHM_ATTACH {"seg": id, "nonce": b16} -> {}   (this connection may now name segment `id` in requests)

A segment belongs to the connections attached to it (the one that opened it is attached): when the
last one closes, the server unmaps and closes it. A client that dies closes its connections, so its
segments go with it. The client places the data: a put names the region where it wrote the blobs; a
get names a free region (offset, capacity) and the server writes the blobs there, back to back, when
they fit (else they come back on the socket). The server copies a put out of the segment before it
verifies it, so a client writing its segment concurrently can only spoil its own put.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
import secrets
import struct
import threading

from kvstore.errors import InvalidArgument

MAGIC = b"KVSHM\x00\x01\x00"
_HEADER = struct.Struct("<8s16sQ")
DATA_START = mmap.PAGESIZE  # the first page holds the header; regions start after it
ALIGN = 64
NONCE_SIZE = 16


def available() -> bool:
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd")


def host_id() -> str:
    """This kernel's boot id: a client only asks for shared memory when the server reports the same one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Segment:
    """A shared-memory segment as its owner (the server) holds it."""

    def __init__(self, seg_id: int, size: int, reserve: bool = True, seals: int = 0) -> None:
        """`reserve`: allocate every page now; `seals`: more seals to add once the owner has mapped it
        (kvstore.tiers.arena: F_SEAL_FUTURE_WRITE, no one else may map it writable)."""
        if size <= DATA_START:
            raise InvalidArgument(f"a segment needs more than {DATA_START} bytes, got {size}")
        self.seg_id = seg_id
        self.size = size
        self.nonce = secrets.token_bytes(NONCE_SIZE)
        self.fd = os.memfd_create(f"kvstore-shm-{seg_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            if reserve:
                os.posix_fallocate(self.fd, 0, size)  # ENOSPC now instead of SIGBUS on a later write
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self.map = mmap.mmap(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(self.fd)
            raise
        self.map[: _HEADER.size] = _HEADER.pack(MAGIC, self.nonce, size)
        self.view = memoryview(self.map)
        # blobs of the server's arena lent to the client that owns this segment, by pin id: they stay
        # alive (their regions taken) until it gives them back or the segment closes
        self.lent: dict[int, tuple[list, int]] = {}
        self.lent_bytes = 0
        self._next_pin = 1

    def lend(self, blobs: list, nbytes: int) -> int:
        pin, self._next_pin = self._next_pin, self._next_pin + 1
        self.lent[pin] = (blobs, nbytes)
        self.lent_bytes += nbytes
        return pin

    def give_back(self, pin: int) -> None:
        """The client is done with the blobs of `pin` (an unknown pin: given back already)."""
        got = self.lent.pop(pin, None)
        if got is not None:
            self.lent_bytes -= got[1]

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        """Unmap and close. The fd is closed whatever happens (no client can open the segment after
        this); a mapping still viewed somewhere (a blob, a table) goes with its last view, logged."""
        self.lent.clear()
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            logging.getLogger(__name__).warning(
                "shared-memory segment %d closed while still viewed: unmapped with its last view", self.seg_id
            )
        finally:
            os.close(self.fd)


def open_segment(path: str, size: int, nonce: bytes, writable: bool = True) -> mmap.mmap | None:
    """The client's mapping of a server segment, or None when it is not the one the server described
    (another host, PID namespace or user): the caller then stays on TCP."""
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    except OSError:
        return None
    finally:
        os.close(fd)
    magic, got_nonce, got_size = _HEADER.unpack_from(mapped)
    if magic != MAGIC or got_nonce != nonce or got_size != size:
        mapped.close()
        return None
    return mapped


class RegionAllocator:
    """First-fit allocation of [DATA_START, size) in ALIGN-byte units. Thread-safe."""

    def __init__(self, size: int) -> None:
        self._starts = [DATA_START]  # free ranges, sorted and never adjacent: [starts[i], ends[i])
        self._ends = [size]
        self._lock = threading.Lock()

    @staticmethod
    def rounded(n: int) -> int:
        return max(ALIGN, -(-n // ALIGN) * ALIGN)

    def alloc(self, n: int) -> int | None:
        """The offset of `n` free bytes, or None if no free range is that large."""
        n = self.rounded(n)
        with self._lock:
            for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
                if end - start >= n:
                    if end - start == n:
                        del self._starts[i], self._ends[i]
                    else:
                        self._starts[i] = start + n
                    return start
        return None

    def largest(self) -> int:
        with self._lock:
            return max((e - s for s, e in zip(self._starts, self._ends, strict=True)), default=0)

    def free(self, offset: int, n: int) -> None:
        n = self.rounded(n)
        end = offset + n
        with self._lock:
            i = bisect.bisect_left(self._starts, offset)
            assert i == len(self._starts) or end <= self._starts[i], "freed a range that overlaps a free one"
            assert i == 0 or self._ends[i - 1] <= offset, "freed a range that overlaps a free one"
            if i < len(self._starts) and self._starts[i] == end:  # merge with the next free range
                end = self._ends[i]
                del self._starts[i], self._ends[i]
            if i > 0 and self._ends[i - 1] == offset:  # and with the previous one
                self._ends[i - 1] = end
            else:
                self._starts.insert(i, offset)
                self._ends.insert(i, end)

    def shrink(self, offset: int, n: int, keep: int) -> None:
        """Give back the tail of an allocation of `n` bytes, keeping its first `keep` bytes."""
        n, keep = self.rounded(n), self.rounded(keep) if keep else 0
        if keep < n:
            self.free(offset + keep, n - keep)
