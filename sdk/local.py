"""`LocalBackend`: the SDK's in-process mode, a `kvstore.store.TieredStore` behind the Backend protocol.

The async twins run the blocking store calls in a worker thread (`asyncio.to_thread`), so an event
loop is never blocked by a disk read or a Redis round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvstore.blob import BlobHeader
from kvstore.store import TieredStore
from kvstore.tiers.base import Blob


class LocalBackend:
    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def get_blob(self, key: str) -> Blob | None:
        return self.store.get_blob(key)

    def get_verified(self, key: str) -> tuple[Blob, BlobHeader] | None:
        """The blob and its parsed header: the store has just verified it, so decoding need not again."""
        return self.store.get_verified(key)

    def batch_get_verified(self, keys: Sequence[str]) -> list[tuple[Blob, BlobHeader] | None]:
        return self.store.batch_get_verified(keys)

    def put_blob(self, key: str, blob: Blob) -> list[str]:
        return self.store.put_blob(key, blob)

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def delete(self, key: str) -> bool:
        return self.store.delete(key)

    def batch_get(self, keys: Sequence[str], reasons: list[str | None] | None = None) -> list[Blob | None]:
        return self.store.batch_get(keys, reasons)

    def batch_put(self, items: Sequence[tuple[str, Blob]]) -> list[list[str]]:
        return self.store.batch_put(items)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.store.batch_exists(keys)

    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        return self.store.lookup(keys)

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        return self.store.lookup_prefix(keys)

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()

    async def aget_blob(self, key: str) -> Blob | None:
        return await asyncio.to_thread(self.store.get_blob, key)

    async def aget_verified(self, key: str) -> tuple[Blob, BlobHeader] | None:
        return await asyncio.to_thread(self.store.get_verified, key)

    async def abatch_get_verified(self, keys: Sequence[str]) -> list[tuple[Blob, BlobHeader] | None]:
        return await asyncio.to_thread(self.store.batch_get_verified, keys)

    async def aput_blob(self, key: str, blob: Blob) -> list[str]:
        return await asyncio.to_thread(self.store.put_blob, key, blob)

    async def aexists(self, key: str) -> bool:
        return await asyncio.to_thread(self.store.exists, key)

    async def adelete(self, key: str) -> bool:
        return await asyncio.to_thread(self.store.delete, key)

    async def abatch_get(self, keys: Sequence[str]) -> list[Blob | None]:
        return await asyncio.to_thread(self.store.batch_get, keys)

    async def abatch_put(self, items: Sequence[tuple[str, Blob]]) -> list[list[str]]:
        return await asyncio.to_thread(self.store.batch_put, items)

    async def abatch_exists(self, keys: Sequence[str]) -> list[bool]:
        return await asyncio.to_thread(self.store.batch_exists, keys)

    async def alookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        return await asyncio.to_thread(self.store.lookup, keys)

    async def alookup_prefix(self, keys: Sequence[str]) -> int:
        return await asyncio.to_thread(self.store.lookup_prefix, keys)

    async def astats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.store.stats)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.store.close)
