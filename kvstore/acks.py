"""What a put or a delete may acknowledge (docs/design.md §9).

An acknowledgement says what was stored: each blob's tiers (`stored_in`, in tier order). A put that
no tier stored is an error: TooLarge when every tier refused it for its size, Unavailable (503) when
every failure was a backend out of reach, NotStored (507) otherwise, the message naming each tier
and its errno. A put or delete after which a tier may still serve an older blob of the key (it could
neither replace, delete nor remember the key) is Unavailable, whatever the other tiers did.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import KVStoreError, NotStored, TooLarge, Unavailable
from kvstore.tiers.base import TOO_LARGE, UNAVAILABLE, TierWriteError


def stale_error(errors: Sequence[TierWriteError], action: str = "replace") -> Unavailable | None:
    """The error for keys some tier may still serve an older blob of, or None."""
    for e in errors:
        if e.stale:
            key = min(e.stale)
            return Unavailable(
                f"{e.tier} could not be reached to {action} {key} and cannot remember to, so it may still "
                f"serve an older blob of it ({e.detail}); retry once {e.tier} is back"
            )
    return None


def put_error(
    keys: Sequence[str], stored_in: Sequence[Sequence[str]], errors: Sequence[TierWriteError]
) -> KVStoreError | None:
    """The error a put of `keys` must raise (None: it may be acknowledged as `stored_in`). A batch
    error carries `stored_in`, so that the reply can still say which blobs are stored where."""
    exc: KVStoreError | None = stale_error(errors)
    missing = [k for k, tiers in zip(keys, stored_in, strict=True) if not tiers]
    if exc is None and missing:
        why = [e for e in errors if any(k in e.failed for k in missing)]
        reasons = {e.failed[k] for e in why for k in missing if k in e.failed}
        what = missing[0] if len(keys) == 1 else f"{len(missing)} of {len(keys)} blobs (first {missing[0]})"
        message = f"not stored: {what}: " + "; ".join(f"{e.tier}: {e.detail}" for e in why)
        cls = TooLarge if reasons == {TOO_LARGE} else Unavailable if reasons == {UNAVAILABLE} else NotStored
        exc = cls(message)
    if exc is not None:
        exc.stored_in = [list(t) for t in stored_in]  # type: ignore[attr-defined]
    return exc
