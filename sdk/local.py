"""`LocalBackend`: the SDK's in-process mode, a `kvstore.store.TieredStore` behind `kvstore.sdk.backend.Backend`.

Blobs come straight from the tiers (immutable buffers the store has just verified, so a lease carries
their headers and nothing is verified twice); the async twins run the store calls on a worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvstore.sdk.backend import Backend, Outgoing, TokenIds, hint_lists
from kvstore.sdk.buffers import BlobLease
from kvstore.sdk.health import StoreHealth

from kvstore import __version__
from kvstore.blob import PreparedBlob
from kvstore.protocol import Blob, ops
from kvstore.store import TieredStore
from kvstore.token_hints import note_hints


class LocalBackend(Backend):
    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def get_blob(self, key: str) -> Blob | None:
        return self.store.get_blob(key)  # tiers hand out immutable buffers: safe for the caller to keep

    def batch_get(self, keys: Sequence[str], reasons: list[str | None] | None = None) -> list[Blob | None]:
        return self.store.batch_get(keys, reasons)

    def lease(
        self, keys: Sequence[str], reasons: list[str | None] | None = None, in_place: bool = False
    ) -> BlobLease:  # the tiers' buffers are immutable: every lease is in place and intact
        keys = list(keys)
        if len(keys) == 1 and reasons is None:  # the store's metrics tell single gets from batches
            hits = [self.store.get_verified(keys[0])]
        else:
            hits = self.store.batch_get_verified(keys, reasons)
        return BlobLease([h and h[0] for h in hits], [h and h[1] for h in hits])

    def put_blob(
        self, key: str, blob: Outgoing, token_ids: TokenIds | None = None, parent: str | None = None
    ) -> list[str]:
        if token_ids is not None or parent is not None:
            return super().put_blob(key, blob, token_ids, parent)
        return self.store.put_blob(key, _laid_out(blob))

    def batch_put(
        self,
        items: Sequence[tuple[str, Outgoing]],
        replaces: Sequence[str] = (),
        token_ids: Sequence[TokenIds | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> list[list[str]]:
        laid = [(k, _laid_out(b)) for k, b in items]
        if token_ids is not None or parents is not None:  # checked as a server checks them
            ids = None if token_ids is None else ops.token_lists(hint_lists(token_ids))
            ups = None if parents is None else ops.parent_keys(list(parents))
            note_hints(self.store, [k for k, _ in laid], [b for _, b in laid], ids, ups)
        stored_in = self.store.batch_put(laid)
        putting = {k for k, _ in items}
        self.batch_delete([k for k in replaces if k not in putting])  # once every blob is stored
        return stored_in

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.store.batch_exists(keys)

    def delete(self, key: str) -> bool:
        return self.store.delete(key)

    def batch_delete(self, keys: Sequence[str]) -> int:
        return sum(bool(self.store.delete(k)) for k in keys)

    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        return self.store.lookup(keys)

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        return self.store.lookup_prefix(keys)

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def health(self) -> StoreHealth:
        started = time.monotonic()
        tiers = tuple(t.name for t in self.store.tiers)
        return StoreHealth("local", True, True, time.monotonic() - started, None, __version__, tiers, "local")

    def close(self) -> None:
        self.store.close()


def _laid_out(blob: Outgoing) -> Blob:
    """A blob in one buffer (the tiers keep `bytes` as they are)."""
    return blob.to_bytes() if isinstance(blob, PreparedBlob) else blob
