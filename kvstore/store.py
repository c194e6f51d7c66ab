"""The tiered store: ordered tiers, promotion, write-through / write-back, admission, TTL (Spec 4).

- Reads look the tiers up top-down. Every blob read is verified; one that fails is a miss for that
  tier, is counted, is deleted from it, and the lookup goes on to the next tier. A hit in a lower tier
  is promoted (copied) into every tier above it.
- Writes go to the top tier at once. With `write_policy="through"` they also go to every lower tier
  before `put_blob` returns; with "back" a background thread writes them from a bounded queue
  (kvstore/write_back.py), and when that queue is full the lower-tier write is dropped and counted
  (a put never blocks on it).
- `admission_hits=N > 0`: a new blob lives only in the top tier until it has been read N times; then
  it is written down like any other put. A blob evicted from the top tier before that is gone.
- A put that does not write the lower tiers now (write-back, admission) deletes the key from them
  before it is acknowledged, so no older blob of it waits below: a dropped or unflushed write-back,
  or a blob never admitted, is a miss there once it leaves the top tier, through restarts too.
- `ttl`: every tier drops a blob `ttl` seconds after it was written into that tier; a promotion is a
  write, so an upper-tier copy lives `ttl` from its promotion.
- A copy a read makes (promotion, admission) never lands over a put or delete of the key that raced
  the read (kvstore/write_fence.py): it is skipped, and the write waits for a copy already under way.
Every miss has a reason (kvstore/miss_log.py: not_stored, evicted, expired, corrupt, unreachable),
counted in `kvstore_miss_reasons_total` and handed to callers that ask (`lookup`, `reasons=`).
- Acknowledgements (kvstore/acks.py): a put returns the tiers that hold each blob; one that no tier
  stored (disk full, no file descriptors...) raises, naming each tier and its errno; so does a put or
  delete after which a tier may still serve an older blob. A read error of a blob a tier holds is an
  error (Unavailable) unless another tier serves the key, never a miss that hides it.
Tiers raise only TierWriteError / TierReadError (Tier protocol); any other exception that escapes one
is logged, counted in `kvstore_tier_errors_total` and treated as a miss / a dropped write, so one
sick tier never takes the store down.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvstore import tier_calls
from kvstore.acks import put_error, stale_error
from kvstore.blob import BlobHeader, bind_blob, verify_blob
from kvstore.clock import SYSTEM, Clock
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, CorruptBlob, InvalidArgument, TooLarge, Unavailable
from kvstore.keys import validate_key
from kvstore.lru import check_ttl
from kvstore.metrics import StoreMetrics
from kvstore.miss_log import MissLog
from kvstore.protocol import Blob
from kvstore.tiers import Tier, make_tier
from kvstore.tiers.base import QUEUE_FULL, TierWriteError, immutable
from kvstore.transcode import check_tier_codecs, transcode
from kvstore.write_back import WriteBack
from kvstore.write_fence import WriteFence

logger = logging.getLogger(__name__)
Verified = tuple[Blob, BlobHeader]  # a blob and the header its checksum pass parsed
_UNPARSED = object()  # a trusted tier's hit whose header nobody asked for (TieredStore._lookup)
MAX_PROBATION = 1 << 20  # keys waiting for admission that the store remembers


class TieredStore:
    """A key -> blob store over ordered tiers (fastest first). Thread-safe."""

    def __init__(
        self, config: StoreConfig | None = None, tiers: list[Tier] | None = None, clock: Clock = SYSTEM
    ) -> None:
        """`tiers`: built already (else each of `config.tiers` by kvstore.tiers.make_tier); `clock`: the
        one clock of everything that expires here, the tiers it builds included (kvstore/clock.py)."""
        self.config = config or StoreConfig()
        self.clock = clock
        c = self.config
        try:
            check_ttl(c.ttl)
        except InvalidArgument as e:
            raise ConfigError(f"ttl: {e}") from None
        if c.write_back_queue < 1 or c.admission_hits < 0:
            raise ConfigError(
                f"need write_back_queue >= 1 and admission_hits >= 0; got "
                f"{c.write_back_queue}, {c.admission_hits}"
            )
        self.tiers: list[Tier] = (
            list(tiers)
            if tiers is not None
            else [make_tier(n, self.config, clock) for n in self.config.tiers]
        )
        if not self.tiers:
            raise ConfigError("a store needs at least one tier")
        if len({t.name for t in self.tiers}) != len(self.tiers):
            raise ConfigError(f"tier names must be unique, got {[t.name for t in self.tiers]}")
        check_tier_codecs(self.config.tier_codec, [t.name for t in self.tiers])
        self._tier_codec = dict(self.config.tier_codec)  # tier name -> codec blobs are kept in there
        self.metrics = StoreMetrics(self.tiers)
        self.registry = self.metrics.registry
        self._ttl = self.config.ttl
        self._admission = self.config.admission_hits
        self._probation: OrderedDict[str, int] = OrderedDict()  # key -> reads so far
        self.miss_log = MissLog(self.config.miss_log_keys)
        self._lock = threading.Lock()
        self._fence = WriteFence()
        self._closed = False
        self._write_back: WriteBack | None = None
        if self.config.write_policy == "back" and len(self.tiers) > 1:
            self._write_back = WriteBack(
                self.config.write_back_queue, self._write_down, self._delete_down, self._drop_down
            )

    # -- writes below the top tier ---------------------------------------------------------------------

    def _failures(self, tier: Tier) -> float:
        """Everything that counts a failed call of `tier` (a rise during a read: it was unreachable)."""
        s = tier.stats
        return s.errors + s.extra.get("fast_fails", 0) + self.metrics.store_errors[tier.name]

    def _miss(self, key: str, reason: str | None = None) -> str:
        reason = reason or self.miss_log.reason(key, self.clock.monotonic(), self._ttl)
        self.metrics.miss_reason[reason].inc()
        return reason

    def _put_tier(self, tier: Tier, items: Sequence[tuple[str, bytes]]) -> TierWriteError | None:
        codec = self._tier_codec.get(tier.name)
        if codec is not None:  # re-encoded once, where it enters the tier (kvstore.transcode)
            items = [(k, transcode(b, k, codec)) for k, b in items]
        evicted, error = tier_calls.put(self.metrics, tier, items, self._ttl)
        if evicted and self._admission and tier is self.tiers[0]:
            with self._lock:
                for key in evicted:
                    self._probation.pop(key, None)
        return error

    def _write_down(self, key: str, blob: bytes) -> None:
        """The write-back thread's write: the put was acknowledged already, so a failure is logged."""
        for tier in self.tiers[1:]:
            error = self._put_tier(tier, [(key, blob)])
            if error is not None and error.stale:
                logger.error(
                    "write-back of %s: %s may serve an older blob (%s)", key, tier.name, error.detail
                )

    def _delete_down(self, key: str) -> None:
        """The write-back thread's undo (the key was deleted or replaced while being written)."""
        errors: list[TierWriteError] = []
        self._clear_lower([key], errors)
        for e in errors:
            logger.error("write-back of %s: %s may serve an older blob (%s)", key, e.tier, e.detail)

    def _clear_lower(self, keys: Sequence[str], errors: list[TierWriteError]) -> None:
        """Delete `keys` from every lower tier; a tier that may still serve one raises into `errors`."""
        for tier in self.tiers[1:]:
            for key in keys:
                try:
                    tier_calls.delete(self.metrics, tier, key)
                except TierWriteError as e:
                    errors.append(e)

    def _take_back(
        self, items: Sequence[tuple[str, bytes]], stored_in: list[list[str]], keys: set[str]
    ) -> None:
        """A put that may not be acknowledged (a tier may still serve an older blob of the key): its new
        blob leaves the tiers that took it, so no read serves it and then, once it is evicted, the
        older one. The key reads as it did before the put (or as a miss)."""
        for (key, _), tiers in zip(items, stored_in, strict=True):
            if key not in keys:
                continue
            if self._write_back is not None:
                self._write_back.cancel(key)
            for tier in self.tiers:
                if tier.name in tiers:
                    try:
                        tier_calls.delete(self.metrics, tier, key)
                    except TierWriteError as e:
                        logger.error("cannot take back %s from %s: %s", key, tier.name, e.detail)
            tiers.clear()

    def _drop_down(self, key: str) -> None:
        for tier in self.tiers[1:]:
            self.metrics.count_drop(tier, QUEUE_FULL)

    def _write_lower(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Admitted blobs (admission_hits): down to every lower tier, by the write policy."""
        if len(self.tiers) < 2 or not items:
            return
        if self._write_back is not None:
            self._write_back.submit(items)
            return
        for tier in self.tiers[1:]:
            self._put_tier(tier, items)

    # -- reads -----------------------------------------------------------------------------------------

    def _verified(self, tier: Tier, key: str, blob: Blob) -> BlobHeader | None:
        try:
            return verify_blob(blob, checksum=not getattr(tier, "trusted", False), key=key)
        except CorruptBlob as e:  # ForeignBlob too: a blob bound to another key is a miss
            logger.warning("corrupt blob %s in tier %s (%s): deleted", key, tier.name, e)
            self.metrics.tier[tier.name].corrupt.inc()
            self.miss_log.corrupt(key)
            try:
                tier_calls.delete(self.metrics, tier, key)
            except TierWriteError as d:  # it stays, but it fails verification on every read
                logger.warning("cannot delete corrupt blob %s from %s: %s", key, tier.name, d.detail)
            return None

    def _lookup(
        self, keys: Sequence[str], reasons: list[str | None] | None = None, headers: bool = True
    ) -> list[Verified | None]:
        """The hits, verified; `headers=False`: the caller wants only the blobs, so a trusted tier's
        (whose blobs were verified at put) are not even parsed, and their header is None."""
        out: list[Verified | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        since = self._fence.now()  # copies of what this read finds must not land over a later write
        why: dict[int, str] = {}  # what this read saw: "corrupt", or "unreachable" for a failing tier
        read_errors: dict[str, str] = {}  # key -> a read error of a blob a tier holds
        for level, tier in enumerate(self.tiers):
            if not pending:
                break
            failures = self._failures(tier)
            blobs = tier_calls.get_many(self.metrics, tier, [keys[j] for j in pending], read_errors)
            if self._failures(tier) > failures:
                why.update((j, "unreachable") for j in pending if j not in why)
            counters = self.metrics.tier[tier.name]
            still: list[int] = []
            found: list[tuple[str, Blob]] = []
            trusted = not headers and getattr(tier, "trusted", False)
            for j, blob in zip(pending, blobs, strict=True):
                if blob is None:
                    header = None
                elif trusted:
                    header = _UNPARSED
                else:
                    header = self._verified(tier, keys[j], blob)
                if header is None:
                    if blob is not None:
                        why[j] = "corrupt"
                    still.append(j)
                    continue
                out[j] = (blob, None if header is _UNPARSED else header)  # type: ignore[assignment]
                found.append((keys[j], blob))
                counters.hits.inc()
                counters.read_bytes.inc(len(blob))
            if still:
                counters.misses.inc(len(still))
            if found and level == 0 and self._admission:
                self._count_reads(found, since)
            if found and level > 0:  # promote into every tier above
                self._promote(found, level, since)
            pending = still
        if pending:
            self.metrics.misses.inc(len(pending))
        if reasons is not None:
            reasons[:] = [None] * len(keys)
        for j in pending:
            reason = self._miss(keys[j], why.get(j))
            if reasons is not None:
                reasons[j] = reason
        failed = [keys[j] for j in pending if keys[j] in read_errors]
        if failed:  # never a miss that hides an error: the blob may be stored, unreadable now
            raise Unavailable(f"cannot read {failed[0]}: {read_errors[failed[0]]}")
        return out

    def _promote(self, found: list[tuple[str, Blob]], level: int, since: int) -> None:
        with self._fence.copying([k for k, _ in found], since) as ok:
            items = [(k, immutable(b)) for (k, b), good in zip(found, ok, strict=True) if good]
            if not items:
                return
            for upper in self.tiers[:level]:
                self._put_tier(upper, items)
        self.miss_log.written([k for k, _ in items], self.clock.monotonic())  # a fresh TTL above

    def _count_reads(self, found: list[tuple[str, Blob]], since: int) -> None:
        """Admission: count top-tier reads of probationary blobs; admit those that reached the bar."""
        admitted: list[tuple[str, bytes]] = []
        with self._lock:
            for key, blob in found:
                n = self._probation.get(key)
                if n is None:
                    continue
                if n + 1 >= self._admission:
                    del self._probation[key]
                    admitted.append((key, immutable(blob)))
                else:
                    self._probation[key] = n + 1
        if not admitted:
            return
        with self._fence.copying([k for k, _ in admitted], since) as ok:
            self._write_lower([item for item, good in zip(admitted, ok, strict=True) if good])

    def get_blob(self, key: str, reasons: list[str | None] | None = None) -> Blob | None:
        """The verified blob stored under `key`, or None. Never mutate the returned buffer.
        `reasons`, a list, receives [why it missed] or [None] on a hit."""
        validate_key(key)
        with self.metrics.time("get"):
            hit = self._lookup([key], reasons, headers=False)[0]
        return None if hit is None else hit[0]

    def get_verified(self, key: str) -> Verified | None:
        """`get_blob` plus the header its verification parsed, for `decode_blob(blob, header=...)`."""
        validate_key(key)
        with self.metrics.time("get"):
            return self._lookup([key])[0]

    def batch_get(self, keys: Sequence[str], reasons: list[str | None] | None = None) -> list[Blob | None]:
        """Blobs in key order, None for misses; `reasons` receives why each one missed (None: a hit)."""
        return [None if hit is None else hit[0] for hit in self._batch_lookup(keys, reasons, headers=False)]

    def batch_get_verified(
        self, keys: Sequence[str], reasons: list[str | None] | None = None
    ) -> list[Verified | None]:
        return self._batch_lookup(keys, reasons)

    def _batch_lookup(
        self, keys: Sequence[str], reasons: list[str | None] | None, headers: bool = True
    ) -> list[Verified | None]:
        for key in keys:
            validate_key(key)
        with self.metrics.time("batch_get"):
            return self._lookup(list(keys), reasons, headers)

    def _contains(self, tier: Tier, key: str) -> bool:
        return tier_calls.call(self.metrics, tier, "contains", tier.contains, key, default=False)

    def _present(self, keys: Sequence[str]) -> list[bool]:
        """Which keys some tier holds: tier by tier, batched where a tier offers `contains_many`."""
        found = [False] * len(keys)
        for tier in self.tiers:
            todo = [j for j, f in enumerate(found) if not f]
            if not todo:
                break
            many = getattr(tier, "contains_many", None)  # optional: one round trip for remote tiers
            if many is not None:
                hits = tier_calls.call(
                    self.metrics, tier, "contains", many, [keys[j] for j in todo], default=[False] * len(todo)
                )
            else:
                hits = [self._contains(tier, keys[j]) for j in todo]
            for j, hit in zip(todo, hits, strict=True):
                found[j] = bool(hit)
        return found

    def exists(self, key: str) -> bool:
        validate_key(key)
        with self.metrics.time("exists"):
            return self._present([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            validate_key(key)
        with self.metrics.time("batch_exists"):
            return self._present(list(keys))

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        """How many leading `keys` are stored (in any tier): the first gap ends the run."""
        return self.lookup(keys)[0]

    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        """(how many leading `keys` are stored, why the next one is not; None when all are)."""
        for key in keys:
            validate_key(key)
        with self.metrics.time("lookup_prefix"):
            failures = [self._failures(t) for t in self.tiers]
            if any(hasattr(t, "contains_many") for t in self.tiers):  # round trips matter: batch
                found = self._present(list(keys))
                n = found.index(False) if False in found else len(found)
            else:
                n = 0  # key by key, top-down: the fewest calls, and nothing past the first gap
                while n < len(keys) and any(self._contains(t, keys[n]) for t in self.tiers):
                    n += 1
            if n == len(keys):
                return n, None
            failed = any(self._failures(t) > f for t, f in zip(self.tiers, failures, strict=True))
            return n, self._miss(keys[n], "unreachable" if failed else None)

    # -- writes ----------------------------------------------------------------------------------------

    def _checked(self, key: str, blob: Blob) -> bytes | memoryview:
        validate_key(key)
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"a blob is bytes-like, got {type(blob).__name__}")
        size = memoryview(blob).nbytes
        if size > self.config.max_blob_size:
            raise TooLarge(f"blob of {size} bytes is over max_blob_size {self.config.max_blob_size}")
        header = verify_blob(blob, key=key)  # CorruptBlob (ForeignBlob: bound to another key): nothing stored
        return immutable(bind_blob(blob, header, key))  # tiers and the write-back queue keep it

    def _store(self, items: list[tuple[str, bytes]]) -> list[list[str]]:
        """Write `items`; return the tiers now holding each, or raise what `acks.put_error` says.

        The top tier first; then every lower tier (write-through), or the write-back queue, or (with
        admission) nothing yet. A blob the top tier could not store goes down to the lower tiers at
        once whatever the policy: an acknowledgement needs a tier that holds it."""
        if self._closed:
            raise InvalidArgument("the store is closed")
        with self._lock:
            for key, _ in items:
                if self._write_back is not None:  # an older queued write-back of the key is now stale
                    self._write_back.cancel(key)
                if self._admission and len(self.tiers) > 1:
                    self._probation[key] = 0
                    self._probation.move_to_end(key)
            while len(self._probation) > MAX_PROBATION:
                self._probation.popitem(last=False)
        top, lower = self.tiers[0], self.tiers[1:]
        errors: list[TierWriteError] = []
        stored_in: list[list[str]] = [[] for _ in items]

        def put(tier: Tier, idx: list[int]) -> list[int]:  # the indices it did not store
            error = self._put_tier(tier, [items[i] for i in idx])
            if error is not None:
                errors.append(error)
            for i in idx:
                if error is None or items[i][0] not in error.failed:
                    stored_in[i].append(tier.name)
            return [i for i in idx if error is not None and items[i][0] in error.failed]

        everything = list(range(len(items)))
        not_on_top = put(top, everything)
        if lower:
            if self._admission or self._write_back is not None:
                sync = not_on_top
                later = [i for i in everything if i not in set(not_on_top)]
                self._clear_lower([items[i][0] for i in later], errors)  # no older blob waits below
                stale = {k for e in errors for k in e.stale}  # not acknowledged (_take_back): not queued
                queued = [] if self._admission else [i for i in later if items[i][0] not in stale]
            else:
                sync, queued = everything, []
            for tier in lower:
                if sync:
                    put(tier, sync)
            if queued:
                assert self._write_back is not None
                self._write_back.submit([items[i] for i in queued])
        stale = {k for e in errors for k in e.stale}
        if stale:
            self._take_back(items, stored_in, stale)
        self.miss_log.written(
            [k for (k, _), tiers in zip(items, stored_in, strict=True) if tiers], self.clock.monotonic()
        )
        error = put_error([k for k, _ in items], stored_in, errors)
        if error is not None:
            raise error
        return stored_in

    def put_blob(self, key: str, blob: Blob) -> list[str]:
        """Store a blob (verified first; CorruptBlob / TooLarge / InvalidKey and nothing stored).
        Returns the tiers that hold it now; raises NotStored / Unavailable / TooLarge (kvstore.acks)
        when no tier stored it, or when a tier may still serve an older blob of the key."""
        item = (key, self._checked(key, blob))
        with self.metrics.time("put"), self._fence.writing([key]):
            return self._store([item])[0]

    def batch_put(self, items: Sequence[tuple[str, Blob]]) -> list[list[str]]:
        """Store several blobs; every one is checked before any is stored. Returns each one's tiers;
        raises as `put_blob` does if any blob was not stored (the error's `stored_in` says the rest)."""
        checked = [(key, self._checked(key, blob)) for key, blob in items]
        with self.metrics.time("batch_put"), self._fence.writing([k for k, _ in checked]):
            return self._store(checked)

    def delete(self, key: str) -> bool:
        """Remove `key` from every tier (and any queued write-back of it). True if any tier had it.
        Raises Unavailable when a tier it may be in could not be reached and cannot remember to
        delete it later: the delete did not happen there, and an older blob may be served."""
        validate_key(key)
        with self.metrics.time("delete"), self._fence.writing([key]):
            if self._write_back is not None:
                self._write_back.cancel(key)
            with self._lock:
                self._probation.pop(key, None)
            self.miss_log.forget(key)
            found, errors = False, []
            for tier in self.tiers:
                try:
                    found = tier_calls.delete(self.metrics, tier, key) or found
                except TierWriteError as e:
                    errors.append(e)
            error = stale_error(errors, "delete")
            if error is not None:
                raise error
            return found

    # -- lifecycle ---------------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` s) until every queued write-back has reached the lower tiers."""
        return self._write_back.flush(timeout) if self._write_back is not None else True

    def stats(self) -> dict[str, Any]:
        s = self.metrics.stats()
        s["write_policy"] = self.config.write_policy
        s["write_back_queued"] = self._write_back.queued() if self._write_back is not None else 0
        return s

    def close(self, timeout: float | None = None) -> None:
        """Drain write-back (at most `timeout` s: what is left is not written below, where those keys
        were deleted when they were queued), stop its thread and close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._write_back is not None:
            self._write_back.close(timeout)
        for tier in self.tiers:
            tier_calls.call(self.metrics, tier, "close", tier.close, default=None)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
