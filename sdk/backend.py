"""The backend interface behind `sdk.Store`: blob-level, sync and async.

`Store` encodes and decodes tensors itself (client side), so a backend only moves verified blobs.
Two implementations: `sdk.local.LocalBackend` (an in-process `kvstore.store.TieredStore`) and
`sdk.remote.RemoteBackend` (the HTTP server, Spec 6). Both raise only `kvstore.errors` types.

Semantics every backend keeps:
- keys are validated with `kvstore.keys.validate_key` (bad key -> InvalidKey);
- `put_blob` rejects a blob that does not verify (CorruptBlob) or is over the size limit (TooLarge),
  storing nothing; it returns the tiers that stored it (`batch_put`: per blob, in order), and raises
  NotStored / Unavailable when no tier did (a full disk is an error, never an acknowledgement);
- a missing key is `None` / `False`, never an exception;
- batch calls keep the order of their inputs; `lookup` is (the number of leading keys present, why the
  next one is missing: kvstore/miss_log.py's reasons), `lookup_prefix` its first half;
- `batch_get(keys, reasons)`: a list given as `reasons` receives why each miss missed (None for a hit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

Blob = bytes | bytearray | memoryview


@runtime_checkable
class Backend(Protocol):
    # sync
    def get_blob(self, key: str) -> Blob | None: ...

    def put_blob(self, key: str, blob: Blob) -> list[str]: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def batch_get(
        self, keys: Sequence[str], reasons: list[str | None] | None = None
    ) -> list[Blob | None]: ...

    def batch_put(self, items: Sequence[tuple[str, Blob]]) -> list[list[str]]: ...

    def batch_exists(self, keys: Sequence[str]) -> list[bool]: ...

    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]: ...

    def lookup_prefix(self, keys: Sequence[str]) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    # async twins
    async def aget_blob(self, key: str) -> Blob | None: ...

    async def aput_blob(self, key: str, blob: Blob) -> list[str]: ...

    async def aexists(self, key: str) -> bool: ...

    async def adelete(self, key: str) -> bool: ...

    async def abatch_get(self, keys: Sequence[str]) -> list[Blob | None]: ...

    async def abatch_put(self, items: Sequence[tuple[str, Blob]]) -> list[list[str]]: ...

    async def abatch_exists(self, keys: Sequence[str]) -> list[bool]: ...

    async def alookup(self, keys: Sequence[str]) -> tuple[int, str | None]: ...

    async def alookup_prefix(self, keys: Sequence[str]) -> int: ...

    async def astats(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...
