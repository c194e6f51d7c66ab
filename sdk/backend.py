"""The backend behind `sdk.Store`: blob-level, sync, with async twins that run it on threads.

`Store` encodes and decodes tensors itself (client side), so a backend only moves blobs. Two
implementations: `kvstore.sdk.local.LocalBackend` (an in-process `kvstore.store.TieredStore`) and
`kvstore.sdk.remote.RemoteBackend` (kvstore-server over its data plane or HTTP, Spec 6). Both raise only
`kvstore.errors` types, and `Store` never asks which one it has.

Semantics every backend keeps:
- keys are validated with `kvstore.keys.validate_key` (bad key -> InvalidKey);
- `put_blob` / `batch_put` store nothing from a request with a blob that does not verify (CorruptBlob)
  or is over the size limit (TooLarge): the store verifies on receipt, so the client does not. They
  return the tiers that stored each blob, and raise NotStored / Unavailable when no tier did (a full
  disk is an error, never an acknowledgement). A blob may be a `kvstore.blob.PreparedBlob`, laid out
  where it goes (a same-host server's shared memory) instead of in a buffer of its own first.
  `batch_put(items, replaces)` deletes `replaces` only once every blob is stored (a failed put
  deletes nothing): the shorter partial chunks a save supersedes. `token_ids` (per item: the chunk's
  token ids, or None) and `parents` (per item: the key before it in its sequence) are hints for a
  server's KV events only (kvstore.token_hints): checked (InvalidArgument), never stored with the blob;
- a missing key is `None` / `False`, never an exception;
- batch calls keep the order of their inputs; `lookup` is (the number of leading keys present, why the
  next one is missing: kvstore/miss_log.py's reasons), `lookup_prefix` its first half;
- `batch_get(keys, reasons)`: a list given as `reasons` receives why each miss missed (None for a hit);
- `get_blob` / `batch_get` return buffers the caller owns; `lease` lends them (`kvstore.sdk.buffers`). Blobs
  are verified by whoever uses them (`decode_blob` does), unless a lease's header says it was.
"""

from __future__ import annotations

import asyncio
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore.sdk.buffers import BlobLease
from kvstore.sdk.health import StoreHealth

from kvstore.blob import PreparedBlob
from kvstore.errors import InvalidArgument
from kvstore.protocol import Blob

T = TypeVar("T")
Outgoing = Blob | PreparedBlob  # what a put sends: a blob, or one laid out on the way
TokenIds = Sequence[int]  # a chunk's token ids (a list, a tuple, a numpy array), a put's hint


def hint_lists(token_ids: Sequence[TokenIds | None]) -> list[list[int] | None]:
    """Per-item token ids as the wires carry them: lists of Python ints (InvalidArgument for a value
    that is not an integer); the server checks the rest (kvstore.protocol.ops.token_lists)."""
    try:
        return [
            None if t is None else [operator.index(x) for x in (t.tolist() if hasattr(t, "tolist") else t)]
            for t in token_ids
        ]
    except TypeError as e:
        raise InvalidArgument(f"token ids must be integers: {e}") from None


class Backend(ABC):
    @abstractmethod
    def get_blob(self, key: str) -> Blob | None: ...

    @abstractmethod
    def batch_get(
        self, keys: Sequence[str], reasons: list[str | None] | None = None
    ) -> list[Blob | None]: ...

    @abstractmethod
    def lease(
        self, keys: Sequence[str], reasons: list[str | None] | None = None, in_place: bool = False
    ) -> BlobLease: ...

    def put_blob(
        self, key: str, blob: Outgoing, token_ids: TokenIds | None = None, parent: str | None = None
    ) -> list[str]:
        if token_ids is None and parent is None:
            return self.batch_put([(key, blob)])[0]
        return self.batch_put([(key, blob)], (), None if token_ids is None else [token_ids], [parent])[0]

    @abstractmethod
    def batch_put(
        self,
        items: Sequence[tuple[str, Outgoing]],
        replaces: Sequence[str] = (),
        token_ids: Sequence[TokenIds | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> list[list[str]]: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def batch_delete(self, keys: Sequence[str]) -> int:
        """Delete every key; how many were stored."""

    @abstractmethod
    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]: ...

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        return self.lookup(keys)[0]

    def lookup_and_exists(
        self, keys: Sequence[str], others: Sequence[str]
    ) -> tuple[int, str | None, list[bool]]:
        """`lookup(keys)` and `batch_exists(others)` (a remote store answers both in one round trip)."""
        n, reason = self.lookup(keys) if keys else (0, None)
        return n, reason, self.batch_exists(others) if others else []

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def health(self) -> StoreHealth:
        """Whether the store answers and accepts this client (never raises over a store that does not)."""

    @abstractmethod
    def close(self) -> None: ...

    # -- async twins: the blocking call on a thread, so an event loop never waits on a socket or a disk

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    async def aget_blob(self, key: str) -> Blob | None:
        return await self._run(self.get_blob, key)

    async def abatch_get(self, keys: Sequence[str]) -> list[Blob | None]:
        return await self._run(self.batch_get, keys)

    async def alease(self, keys: Sequence[str], reasons: list[str | None] | None = None) -> BlobLease:
        return await self._run(self.lease, keys, reasons)

    async def aput_blob(
        self, key: str, blob: Blob, token_ids: TokenIds | None = None, parent: str | None = None
    ) -> list[str]:
        return await self._run(self.put_blob, key, blob, token_ids, parent)

    async def abatch_put(
        self,
        items: Sequence[tuple[str, Outgoing]],
        replaces: Sequence[str] = (),
        token_ids: Sequence[TokenIds | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> list[list[str]]:
        return await self._run(self.batch_put, items, replaces, token_ids, parents)

    async def aexists(self, key: str) -> bool:
        return await self._run(self.exists, key)

    async def abatch_exists(self, keys: Sequence[str]) -> list[bool]:
        return await self._run(self.batch_exists, keys)

    async def adelete(self, key: str) -> bool:
        return await self._run(self.delete, key)

    async def abatch_delete(self, keys: Sequence[str]) -> int:
        return await self._run(self.batch_delete, keys)

    async def alookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        return await self._run(self.lookup, keys)

    async def alookup_prefix(self, keys: Sequence[str]) -> int:
        return await self._run(self.lookup_prefix, keys)

    async def astats(self) -> dict[str, Any]:
        return await self._run(self.stats)

    async def ahealth(self) -> StoreHealth:
        return await self._run(self.health)

    async def aclose(self) -> None:
        await self._run(self.close)
