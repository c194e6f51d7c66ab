"""`RemoteBackend`: `kvstore.sdk.backend.Backend` against a kvstore-server, over the fastest transport it offers.

`transport`:
- "auto" (default): the binary data plane on the server's port (`kvstore.protocol.dataplane`), with blobs in
  shared memory when the server runs on this host (`kvstore.protocol.shm`), else on the socket; plain HTTP
  when the server does not speak the data plane.
- "shm": the same, but an error (Unavailable) when shared memory cannot be set up.
- "tcp": the data plane, never shared memory. "http": HTTP only (docs/design.md §6, §7).
Auth, limits, checksums and errors are the same on every transport: the server applies them all.

Each wire is one class with the same methods (`kvstore.sdk.http_transport.HttpTransport`,
`kvstore.sdk.plane_transport.PlaneTransport`), and each operation's request and answer are those of
kvstore.protocol.ops: this class picks the wire and says what to ask, never how a wire spells it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvstore.sdk import transfers as tr
from kvstore.sdk.backend import Backend, Outgoing, TokenIds, hint_lists
from kvstore.sdk.buffers import BlobLease, BufferPool, Loan, LoanBook
from kvstore.sdk.dataplane import SPIN_S, DataPlaneClient, NotSpoken
from kvstore.sdk.health import StoreHealth, probe
from kvstore.sdk.http import HttpClient, tls_context
from kvstore.sdk.http_transport import HttpTransport
from kvstore.sdk.options import ClientOptions, failure
from kvstore.sdk.plane_transport import PlaneTransport

from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.keys import validate_key
from kvstore.protocol import Blob, ops
from kvstore.settings import check_token

log = logging.getLogger(__name__)
T = TypeVar("T")
TRANSPORTS = ("auto", "shm", "tcp", "http")
# token ids a put carries as hints at most (~5 bytes each in msgpack: within a request's 1 MiB meta or
# frame header, with 4096 keys beside them)
MAX_HINT_TOKENS_PER_REQUEST = 131_072
Wire = HttpTransport | PlaneTransport


class RemoteBackend(Backend):
    """Talks to a kvstore-server. Thread-safe (pools of connections)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 10.0,
        connect_timeout: float = 3.0,
        retries: int = 2,
        backoff: float = 0.05,
        retry_timeouts: bool = False,
        pool_size: int = 16,
        verify_tls: bool | str = True,
        transport: str = "auto",
        shm_size: int = 256 * 2**20,
        spin_us: float = SPIN_S * 1e6,
        read_index: bool = True,
    ) -> None:
        """`timeout`: the longest a call waits for the server (a call that gets no answer fails then,
        Unavailable); `connect_timeout` for a connection. `retries`: how often a call is tried again
        after a connection error or a 502/503/504 (with `backoff`, doubling), never once it is older
        than `timeout`, and after a timeout only with `retry_timeouts` (sdk.options). So a hung server
        costs a call about `timeout` seconds, an unreachable one `connect_timeout`.
        `spin_us`: how long a call polls for the answer of a server on this host before its thread
        sleeps (sdk.dataplane; 0: never poll). `read_index`: with shared memory, read the blobs of the
        server's cpu arena straight from it when its index says where they lie, without a request
        (kvstore.protocol.arena_table; False: every get asks the server)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(f"server URL must be http(s)://host[:port], got {url!r}")
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not (isinstance(spin_us, (int, float)) and 0 <= spin_us < 1e6):
            raise InvalidArgument(f"spin_us must be between 0 and 1e6 microseconds, got {spin_us!r}")
        self.url = url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        tls = tls_context(verify_tls) if parts.scheme == "https" else None
        self._options = ClientOptions(timeout, connect_timeout, retries, backoff, pool_size, retry_timeouts)
        self._tls, self._token = tls, token and check_token(token, "the token given to the SDK")
        self.http = HttpClient(self.host, self.port, tls, token, self._options)
        self._http = HttpTransport(self.http)
        self.wanted = transport
        self.shm_size = shm_size
        self._spin_us = spin_us
        self._read_index = read_index
        self.plane: PlaneTransport | None = None  # the data plane, once it answered HELLO
        self._plane_state = "off" if transport == "http" else "untried"  # -> "on" / "off"
        self._buffers = BufferPool()
        self._loans = LoanBook()  # leases whose views were still exported when released
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pool_size = pool_size
        self._closed = False
        # calls by the path their blobs took: shm, tcp, http, index (copied out of the arena without a
        # request) or in_place (lent where they lie in the arena, without a request)
        self.counts: Counter[str] = Counter()

    # -- the wire ----------------------------------------------------------------------------------------

    @property
    def transport(self) -> str:
        """What calls use now: "shm", "tcp" or "http" (negotiates on first use)."""
        return self._wire().name

    def _wire(self) -> Wire:
        """The data plane (negotiated on first use) or, when the server does not speak it, HTTP."""
        if self._closed:
            raise InvalidArgument("this RemoteBackend is closed")
        if self._plane_state == "untried":
            with self._lock:
                if self._plane_state == "untried":
                    self._open_plane()
        if self.plane is not None:
            return self.plane
        if self._plane_state == "off" and self.wanted in ("shm", "tcp"):
            raise Unavailable(f"{self.url} does not offer the data plane (transport={self.wanted!r})")
        return self._http

    def _open_plane(self) -> None:
        try:
            client = DataPlaneClient(self.host, self.port, self._tls, self._token, self._options,
                                     local=self.wanted in ("auto", "shm"), spin_s=self._spin_us / 1e6)  # fmt: skip
        except NotSpoken:
            log.info("%s does not speak the data plane: using HTTP", self.url)
            self._plane_state = "off"
            return
        except TimeoutError as e:  # it accepted and did not answer: HTTP would wait as long
            raise failure(f"HELLO to {self.url}", e, self._options.timeout) from None
        except (OSError, ConnectionError) as e:  # try again on the next call; HTTP now
            log.debug("data plane of %s not reachable (%s)", self.url, e)
            return
        self.plane = PlaneTransport(
            client, self.url, self.wanted, self.shm_size, self._read_index, self.counts
        )
        self._plane_state = "on"

    # -- gets --------------------------------------------------------------------------------------------

    def _fetch(
        self, keys: list[str], lend: bool, reasons: list[str | None] | None = None
    ) -> tuple[list[Blob | None], Loan | None, list | None]:
        """The blobs of `keys` in caller-owned buffers (lend=False) or in lent ones, with their Loan,
        and their headers where this process verified them (else None); `reasons` (if given) receives
        why each miss missed."""
        self._loans.retry()
        rx = tr.Receiver(self._buffers if lend else None)
        wire = self._wire()
        if isinstance(wire, HttpTransport):
            self.counts["http"] += 1
            return (*wire.get(keys, rx, reasons), None)
        return wire.get(keys, rx, reasons)

    def get_blob(self, key: str) -> Blob | None:
        return self._fetch([validate_key(key)], lend=False)[0][0]

    def batch_get(self, keys: Sequence[str], reasons: list[str | None] | None = None) -> list[Blob | None]:
        if not keys:
            if reasons is not None:
                reasons[:] = []
            return []
        return self._fetch([validate_key(k) for k in keys], lend=False, reasons=reasons)[0]

    def lease(
        self, keys: Sequence[str], reasons: list[str | None] | None = None, in_place: bool = False
    ) -> BlobLease:
        if not keys:
            if reasons is not None:
                reasons[:] = []
            return BlobLease([])
        keys = [validate_key(k) for k in keys]
        wire = self._wire() if in_place else None
        if isinstance(wire, PlaneTransport):
            self._loans.retry()
            lent = wire.lend_in_place(keys)
            if lent is not None:
                blobs, headers, loan, intact = lent
                if reasons is not None:
                    reasons[:] = [None] * len(keys)
                return BlobLease(blobs, headers, on_release=lambda: self._loans.end(loan), intact=intact)
        blobs, loan, headers = self._fetch(keys, lend=True, reasons=reasons)
        if loan is None:
            return BlobLease(blobs, headers)
        return BlobLease(blobs, headers, on_release=lambda: self._loans.end(loan))

    # -- puts and the rest -------------------------------------------------------------------------------

    def batch_put(
        self,
        items: Sequence[tuple[str, Outgoing]],
        replaces: Sequence[str] = (),
        token_ids: Sequence[TokenIds | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> list[list[str]]:
        """Store the blobs; returns the tiers that stored each one (the server's acknowledgement). Then
        `replaces` go: in the put's own request (the server deletes them once every blob is stored),
        or, from a server (or a wire) that does not say it did, in one DELETE after it. Token hints go
        in the request, checked by the server (InvalidArgument); past MAX_HINT_TOKENS_PER_REQUEST
        token ids in all, the put goes without them (its events then carry none)."""
        if not items:
            return []
        keys = [validate_key(k) for k, _ in items]
        blobs = [b for _, b in items]
        putting = set(keys)
        gone = [k for k in dict.fromkeys(validate_key(k) for k in replaces) if k not in putting]
        req = ops.PutRequest(keys, [tr.nbytes(b) for b in blobs], gone or None)
        if token_ids is not None or parents is not None:
            req.token_ids = None if token_ids is None else hint_lists(token_ids)
            req.parents = None if parents is None else list(parents)
            if (
                req.token_ids is not None
                and sum(len(t or ()) for t in req.token_ids) > MAX_HINT_TOKENS_PER_REQUEST
            ):
                log.debug("a put of %d chunks goes without its token hints: too many token ids", len(keys))
                req.token_ids = req.parents = None
        wire = self._wire()
        if isinstance(wire, HttpTransport):
            self.counts["http"] += 1
        else:
            self._loans.retry()
        answer = wire.put(req, blobs)
        if gone and answer.replaced is None:  # not asked (HTTP), or a server that predates it
            self.batch_delete(gone)
        return answer.stored_in

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return self._wire().call(ops.EXISTS, ops.KeysRequest([validate_key(k) for k in keys])).exists

    def delete(self, key: str) -> bool:
        return self.batch_delete([key]) > 0

    def batch_delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        return self._wire().call(ops.DELETE, ops.KeysRequest([validate_key(k) for k in keys])).deleted

    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        if not keys:
            return 0, None
        answer = self._wire().call(ops.LOOKUP, ops.LookupRequest([validate_key(k) for k in keys]))
        return answer.prefix, answer.miss

    def lookup_and_exists(
        self, keys: Sequence[str], others: Sequence[str]
    ) -> tuple[int, str | None, list[bool]]:
        """One LOOKUP that also names `others` (`also`); a server that predates `also` ignores them and
        answers without it: then a second call asks."""
        if not keys or not others:
            return super().lookup_and_exists(keys, others)
        req = ops.LookupRequest([validate_key(k) for k in keys], [validate_key(k) for k in others])
        answer = self._wire().call(ops.LOOKUP, req)
        present = answer.also
        if present is None or len(present) != len(others):
            present = self.batch_exists(others)
        return answer.prefix, answer.miss, present

    def stats(self) -> dict[str, Any]:
        return self._http.stats()

    def _probe(self) -> tuple[StoreHealth, KVStoreError | None]:
        return probe(
            self.url, lambda: self.http.request("GET", "/healthz").json(), self.stats, lambda: self.transport
        )

    def health(self) -> StoreHealth:
        """Whether the server answers (`/healthz`, no token needed), accepts this client's token (an
        authenticated `/v1/stats`), and what it runs. Never raises over a server that is down, hung,
        not a kvstore-server or refusing the token: the answer says which (`error`), within about
        `timeout` seconds."""
        return self._probe()[0]

    def check(self) -> None:
        """Raise now what a call would: Unavailable (down, hung, not a kvstore-server: the message says
        which) or Unauthorized (a token missing or wrong)."""
        err = self._probe()[1]
        if err is not None:
            raise err

    def close(self) -> None:
        with self._lock:
            self._closed = True
            plane, self.plane, self._plane_state = self.plane, None, "off"
        if plane is not None:
            plane.close()
        self._http.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._pool_size, thread_name_prefix="kvstore-sdk")
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def __enter__(self) -> RemoteBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
