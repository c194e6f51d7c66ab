"""`RemoteBackend`: `kvstore.sdk.backend.Backend` against a kvstore-server, over the fastest transport it offers.

`transport`:
- "auto" (default): the binary data plane on the server's port (`kvstore.protocol.dataplane`), with blobs in
  shared memory when the server runs on this host (`kvstore.protocol.shm`), else on the socket; plain HTTP
  when the server does not speak the data plane.
- "shm": the same, but an error (Unavailable) when shared memory cannot be set up.
- "tcp": the data plane, never shared memory. "http": HTTP only (docs/design.md §6, §7).
Auth, limits, checksums and errors are the same on every transport: the server applies them all.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvstore.sdk import transfers as tr
from kvstore.sdk.backend import Backend, Outgoing
from kvstore.sdk.buffers import BlobLease, BufferPool, Loan, LoanBook
from kvstore.sdk.dataplane import SPIN_S, DataPlaneClient, NotSpoken, SegmentGone
from kvstore.sdk.health import StoreHealth
from kvstore.sdk.http import HttpClient
from kvstore.sdk.options import ClientOptions, failure
from kvstore.sdk.shm import ClientArena, ClientSegment
from kvstore.sdk.touches import TouchReporter

from kvstore.errors import InvalidArgument, KVStoreError, TooLarge, Unavailable
from kvstore.keys import validate_key
from kvstore.protocol import Blob, shm, wire
from kvstore.protocol import dataplane as dp
from kvstore.protocol.arena_table import IndexReader, usable_here
from kvstore.settings import check_token

log = logging.getLogger(__name__)
T = TypeVar("T")
TRANSPORTS = ("auto", "shm", "tcp", "http")
SHM_MIN_BLOB = 16 * 1024  # smaller blobs gain nothing from shared memory: they ride in the request
# A lease of more bytes than this is lent by the server where the blobs lie rather than copied out of
# its arena without a request: past ~3 MiB the round trip (~0.2-0.3 ms) costs less than the copy
# (~0.07 ms/MiB more than verifying in place; bench_server.py: 4 MiB and 8 x 1 MiB lent and verified
# ran at 1.1-1.3x the copy, 8 x 256 KiB at 0.65x)
INDEX_LEASE_MAX = 3 * 2**20


def _tell_through(backend: weakref.ref) -> Callable[[int, dict], None]:
    def tell(op: int, meta: dict) -> None:
        be = backend()
        plane = None if be is None else be._plane
        if plane is not None:
            plane.tell(op, meta)

    return tell


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
        tls: ssl.SSLContext | None = None
        if parts.scheme == "https":
            tls = ssl.create_default_context(cafile=verify_tls if isinstance(verify_tls, str) else None)
            if verify_tls is False:
                tls.check_hostname = False
                tls.verify_mode = ssl.CERT_NONE
        self._options = ClientOptions(timeout, connect_timeout, retries, backoff, pool_size, retry_timeouts)
        self._tls, self._token = tls, token and check_token(token, "the token given to the SDK")
        self.http = HttpClient(self.host, self.port, tls, token, self._options)
        self.wanted = transport
        self.shm_size = shm_size
        self._spin_us = spin_us
        self._read_index = read_index
        self._touches = TouchReporter(_tell_through(weakref.ref(self)))
        # a backend dropped without close() still goes at once (no cycle through the reporter), and
        # takes the reporter's thread with it
        weakref.finalize(self, self._touches.close)
        self._plane: DataPlaneClient | None = None
        self._plane_state = "off" if transport == "http" else "untried"  # -> "on" / "off"
        self._segment: ClientSegment | None = None
        self._shm_state = "done" if transport in ("http", "tcp") else "untried"  # done: _segment is final
        self._buffers = BufferPool()
        self._loans = LoanBook()  # leases whose views were still exported when released
        self._blob_hint = 8 * 2**20  # room a get asks for per key in shared memory; grows with what it sees
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pool_size = pool_size
        self._closed = False
        # calls by the path their blobs took: shm, tcp, http, index (copied out of the arena without a
        # request) or in_place (lent where they lie in the arena, without a request)
        self.counts: Counter[str] = Counter()

    # -- transport negotiation ---------------------------------------------------------------------------

    @property
    def transport(self) -> str:
        """What calls use now: "shm", "tcp" or "http" (negotiates on first use)."""
        plane = self._data_plane()
        if plane is None:
            return "http"
        return "shm" if self._shm() is not None else "tcp"

    def _data_plane(self) -> DataPlaneClient | None:
        if self._closed:
            raise InvalidArgument("this RemoteBackend is closed")
        if self._plane_state == "untried":
            with self._lock:
                if self._plane_state == "untried":
                    try:
                        self._plane = DataPlaneClient(
                            self.host,
                            self.port,
                            self._tls,
                            self._token,
                            self._options,
                            local=self.wanted in ("auto", "shm"),
                            spin_s=self._spin_us / 1e6,
                        )
                        self._plane_state = "on"
                    except NotSpoken:
                        log.info("%s does not speak the data plane: using HTTP", self.url)
                        self._plane_state = "off"
                    except TimeoutError as e:  # it accepted and did not answer: HTTP would wait as long
                        raise failure(f"HELLO to {self.url}", e, self._options.timeout) from None
                    except (OSError, ConnectionError) as e:  # try again on the next call; HTTP now
                        log.debug("data plane of %s not reachable (%s)", self.url, e)
        if self._plane_state == "off" and self.wanted in ("shm", "tcp"):
            raise Unavailable(f"{self.url} does not offer the data plane (transport={self.wanted!r})")
        return self._plane

    def _shm(self) -> ClientSegment | None:
        plane = self._plane
        if self._shm_state == "untried" and plane is not None:
            with self._lock:
                if self._shm_state == "untried":
                    self._segment = self._open_segment(plane)
                    self._shm_state = "done"
        if self._segment is None and self.wanted == "shm":
            raise Unavailable(f"shared memory with {self.url} is not available")
        return self._segment

    def _open_segment(self, plane: DataPlaneClient) -> ClientSegment | None:
        if not plane.hello.get("shm") or plane.hello.get("host") != shm.host_id() or not shm.host_id():
            return None  # the server offers none, or runs on another host
        try:
            opened = plane.open_segment(self.shm_size)
        except (KVStoreError, OSError, ConnectionError) as e:
            log.info("no shared memory from %s (%s): blobs go over TCP", self.url, e)
            return None
        if opened is None:
            log.info("%s has no shared memory to give (budget spent?): blobs go over TCP", self.url)
            return None
        meta, conn = opened
        mapped = shm.open_segment(meta["path"], meta["size"], meta["nonce"])
        if mapped is None:  # another PID namespace or user: closing the connection frees the segment
            plane.drop(conn)
            log.info("cannot map the shared memory of %s: blobs go over TCP", self.url)
            return None
        plane.keep(conn)
        arena = None
        described = plane.hello.get("arena")
        if isinstance(described, list) and len(described) == 3:
            path, size, nonce = described
            arena_map = shm.open_segment(path, size, nonce, writable=False)
            if arena_map is not None:
                arena = ClientArena(size, nonce, arena_map, self._map_index(plane.hello, size))
        return ClientSegment(meta["seg"], meta["size"], meta["nonce"], mapped, arena)

    def _map_index(self, hello: dict, arena_size: int) -> IndexReader | None:
        described = hello.get("index")
        if (
            not self._read_index
            or not usable_here()
            or not isinstance(described, list)
            or len(described) != 5
        ):
            return None
        path, size, nonce, slots, seed = described
        mapped = shm.open_segment(path, size, nonce, writable=False)
        if mapped is None or type(slots) is not int or type(seed) is not int:
            return None
        try:
            return IndexReader(mapped, slots, seed, arena_size)
        except ValueError as e:
            mapped.close()
            log.info("not reading the arena index of %s: %s", self.url, e)
            return None

    def _forget_segment(self, seg: ClientSegment) -> None:
        """The server restarted and lost `seg`: the next call maps a new one (leases of it stay valid)."""
        with self._lock:
            if self._segment is seg:
                self._segment, self._shm_state = None, "untried"
        log.info("the shared-memory segment of %s is gone (server restart?): mapping a new one", self.url)

    # -- gets --------------------------------------------------------------------------------------------

    def _fetch(
        self, keys: list[str], lend: bool, reasons: list[str | None] | None = None
    ) -> tuple[list[Blob | None], Loan | None, list | None]:
        """The blobs of `keys` in caller-owned buffers (lend=False) or in lent ones, with their Loan,
        and their headers where this process verified them (else None); `reasons` (if given) receives
        why each miss missed."""
        self._loans.retry()
        rx = tr.Receiver(self._buffers if lend else None)
        plane = self._data_plane()
        if plane is None:
            self.counts["http"] += 1
            return (*tr.fetch_http(self.http, keys, rx, reasons), None)
        seg = self._shm()
        read = self._via_index(
            seg, keys, lambda arena: tr.fetch_index(arena, keys, rx, INDEX_LEASE_MAX), "index"
        )
        if read is not None:
            if reasons is not None:
                reasons[:] = [None] * len(keys)
            (blobs, loan), headers = read
            return blobs, loan, headers
        got = None
        if seg is not None:
            try:
                got = tr.fetch_shm(plane, seg, keys, rx, len(keys) * self._blob_hint)
            except SegmentGone:
                self._forget_segment(seg)
        if got is not None:
            meta, (blobs, loan), in_shm = got
            if not in_shm:  # too large for the room asked: ask for more next time
                self._blob_hint = max([self._blob_hint, *(len(b) for b in blobs if b is not None)])
        else:
            in_shm = False
            meta, (blobs, loan) = tr.fetch_socket(plane, keys, rx)
        self.counts["shm" if in_shm else "tcp"] += 1
        if reasons is not None:
            reasons[:] = tr.reasons_of(meta, blobs)
        return blobs, loan, None

    def _via_index(
        self, seg: ClientSegment | None, keys: list[str], read: Callable[[ClientArena], T | None], path: str
    ) -> T | None:
        """`read(arena)`: blobs of a same-host server's arena found by its index, without a request
        (None: ask the server). What it read is reported to the server and counted as `path`."""
        if seg is None or seg.arena is None or seg.arena.index is None or len(keys) > wire.MAX_BATCH_KEYS:
            return None
        started = time.perf_counter()
        got = read(seg.arena)
        if got is not None:  # the server counts the reads as gets and refreshes their recency
            self._touches.add(keys, time.perf_counter() - started)
            self.counts[path] += 1
        return got

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
        if in_place:
            self._loans.retry()
            seg = self._shm() if self._data_plane() is not None else None
            lent = self._via_index(seg, keys, lambda arena: tr.lend_index(arena, keys), "in_place")
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

    def put_blob(self, key: str, blob: Outgoing) -> list[str]:
        return self.batch_put([(key, blob)])[0]

    def batch_put(
        self, items: Sequence[tuple[str, Outgoing]], replaces: Sequence[str] = ()
    ) -> list[list[str]]:
        """Store the blobs; returns the tiers that stored each one (the server's acknowledgement). Then
        `replaces` go: in the put's own request (`x`: the server deletes them once every blob is stored),
        or, from a server that does not say it did, in one DELETE after it."""
        if not items:
            return []
        keys = [validate_key(k) for k, _ in items]
        blobs = [b for _, b in items]
        lens = [tr.nbytes(b) for b in blobs]
        putting = set(keys)
        gone = [k for k in dict.fromkeys(validate_key(k) for k in replaces) if k not in putting]
        plane = self._data_plane()
        if plane is None:
            self.counts["http"] += 1
            stored_in = tr.put_http(self.http, keys, blobs)
            if gone:
                self.batch_delete(gone)
            return stored_in
        limit = plane.hello["max_blob"] if len(items) == 1 else plane.hello["max_request"]
        if sum(lens) > limit or max(lens) > plane.hello["max_blob"]:
            raise TooLarge(f"put of {sum(lens)} bytes is over the server's limit ({limit})")
        self._loans.retry()
        seg = self._shm() if sum(lens) >= SHM_MIN_BLOB else None
        answer = None
        if seg is not None:
            try:
                answer = tr.put_shm(plane, seg, keys, lens, blobs, gone)
            except SegmentGone:
                self._forget_segment(seg)
            if answer is not None:
                self.counts["shm"] += 1
        if answer is None:
            self.counts["tcp"] += 1
            answer = tr.put_socket(plane, keys, lens, blobs, gone)
        if gone and not isinstance(answer.get("x"), list):  # a server that predates `x` ignored it
            self.batch_delete(gone)
        return answer["stored_in"]

    def _keys_call(self, op: int, keys: Sequence[str]) -> dict:
        plane = self._data_plane()
        assert plane is not None
        return plane.call(op, {"k": list(keys)})[1]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        keys = [validate_key(k) for k in keys]
        if self._data_plane() is None:
            if len(keys) == 1:
                return [self.http.request("HEAD", wire.chunk_path(keys[0])).status == 200]
            return [bool(x) for x in self.http.keys_request(wire.BATCH_EXISTS_PATH, keys).json()["exists"]]
        return [bool(x) for x in self._keys_call(dp.EXISTS, keys)["e"]]

    def delete(self, key: str) -> bool:
        key = validate_key(key)
        if self._data_plane() is None:
            return self.http.request("DELETE", wire.chunk_path(key)).status != 404
        return bool(self._keys_call(dp.DELETE, [key])["d"][0])

    def batch_delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        keys = [validate_key(k) for k in keys]
        if self._data_plane() is None:
            return int(self.http.keys_request(wire.BATCH_DELETE_PATH, keys).json()["deleted"])
        return sum(bool(x) for x in self._keys_call(dp.DELETE, keys)["d"])

    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        if not keys:
            return 0, None
        keys = [validate_key(k) for k in keys]
        if self._data_plane() is None:
            answer = self.http.keys_request(wire.LOOKUP_PATH, keys).json()
            n, miss = answer["prefix"], answer.get("miss")  # servers before miss reasons answer without it
        else:
            answer = self._keys_call(dp.LOOKUP, keys)
            n, miss = answer["n"], answer.get("miss")
        return int(n), miss if isinstance(miss, str) else None

    def lookup_and_exists(
        self, keys: Sequence[str], others: Sequence[str]
    ) -> tuple[int, str | None, list[bool]]:
        """One LOOKUP that also names `others` (`x` on the data plane, `also` in the JSON body); a server
        that predates `others` ignores them and answers without the field: then a second call asks."""
        if not keys or not others:
            return super().lookup_and_exists(keys, others)
        keys, others = [validate_key(k) for k in keys], [validate_key(k) for k in others]
        plane = self._data_plane()
        if plane is None:
            payload = json.dumps({"keys": keys, "also": others}).encode()
            answer = self.http.request("POST", wire.LOOKUP_PATH, [payload], wire.JSON_CONTENT_TYPE).json()
            n, miss, present = answer["prefix"], answer.get("miss"), answer.get("also")
        else:
            answer = plane.call(dp.LOOKUP, {"k": keys, "x": others})[1]
            n, miss, present = answer["n"], answer.get("miss"), answer.get("x")
        if not isinstance(present, list) or len(present) != len(others):
            present = self.batch_exists(others)
        return int(n), miss if isinstance(miss, str) else None, [bool(x) for x in present]

    def stats(self) -> dict[str, Any]:
        return self.http.request("GET", wire.STATS_PATH).json()

    def _probe(self) -> tuple[StoreHealth, KVStoreError | None]:
        started = time.monotonic()

        def answer(
            reachable: bool, err: KVStoreError | None, **more: Any
        ) -> tuple[StoreHealth, KVStoreError | None]:
            error = None if err is None else f"{type(err).__name__}: {err}"
            return StoreHealth(
                self.url, reachable, err is None, time.monotonic() - started, error, **more
            ), err

        try:
            alive = self.http.request("GET", "/healthz").json()
        except Unavailable as e:
            return answer(False, e)
        except (KVStoreError, ValueError) as e:  # an HTTP server, but not ours (a 404, HTML...)
            return answer(False, Unavailable(f"{self.url} is not a kvstore-server (/healthz: {e})"))
        if not isinstance(alive, dict) or alive.get("status") != "ok":
            return answer(False, Unavailable(f"{self.url} is not a kvstore-server (/healthz: {alive!r:.80})"))
        try:
            stats = self.stats()  # authenticated: proves the token
            transport = self.transport
        except KVStoreError as e:
            return answer(True, e)
        tiers = tuple(str(t.get("name")) for t in stats.get("tiers", ()))
        version = (stats.get("server") or {}).get("version")
        return answer(True, None, version=version, tiers=tiers, transport=transport)

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
        self._touches.close()  # what it still holds goes out first
        with self._lock:
            self._closed = True
            plane, self._plane, self._plane_state = self._plane, None, "off"
            seg, self._segment, self._shm_state = self._segment, None, "done"
        if plane is not None:
            plane.close()
        if seg is not None:
            seg.close()
        self.http.close()
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
