"""`Store`: the one SDK class, in-process (`Store.local`) or against a server (`Store.connect`).

    from kvstore.sdk import Store
    with Store.local(tiers=["cpu", "disk"], cpu_capacity="1GiB") as store:
        store.put(key, kv)                 # a [2, layers, tokens, kv_heads, head_dim] tensor, or a blob
        kv2 = store.get(key)               # a tensor, or None
        n = store.lookup_prefix(keys)      # leading chunks present
        n, why = store.lookup(keys)        # ... and why the next one is missing (evicted, expired...)

Tensors are encoded (codec, lz4) and decoded here, on the client; backends only move blobs. A blob is
verified where it crosses a trust boundary: by the store when it receives one, by the reader when it
uses one (`get` does; `get_blob` callers decode or `verify_blob` themselves). `lease_blobs` lends
blobs without a copy until released (`kvstore.sdk.buffers`). Every call has an async twin with an `a` prefix
(`aput`, `aget`, ...). Errors are kvstore.errors types.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from kvstore.sdk.backend import Backend, Outgoing, TokenIds
from kvstore.sdk.buffers import BlobLease
from kvstore.sdk.health import StoreHealth
from kvstore.sdk.local import LocalBackend
from pydantic import ValidationError

from kvstore.blob import BlobHeader, PreparedBlob, decode_blob, prepare_blob
from kvstore.config import StoreConfig, default_data_dir
from kvstore.errors import ConfigError, CorruptBlob, InvalidArgument
from kvstore.protocol import Blob
from kvstore.store import TieredStore

logger = logging.getLogger(__name__)
KVOrBlob = torch.Tensor | bytes | bytearray | memoryview | PreparedBlob


class Store:
    """Put and get KV chunks by key. Use `Store.local(...)` or `Store.connect(url)` to make one."""

    def __init__(
        self, backend: Backend, codec: str = "raw", lz4: bool = False, codec_options: dict | None = None
    ) -> None:
        self.backend = backend
        self.codec = codec
        self.lz4 = lz4
        self.codec_options = dict(codec_options or {})

    @classmethod
    def local(
        cls,
        tiers: Sequence[str] | None = None,
        config: StoreConfig | str | Path | None = None,
        **overrides: Any,
    ) -> Store:
        """An in-process tiered store. `tiers` and `overrides` (any StoreConfig field) win over `config`:
        a StoreConfig, or a YAML file / None for `StoreConfig.load` (defaults < YAML < KVSTORE_* env).
        Its default disk directory is ~/.cache/kvstore/data/local, apart from kvstore-server's."""
        if tiers is not None:
            overrides["tiers"] = list(tiers)
        if config is None or isinstance(config, (str, Path)):
            defaults = {"disk_path": default_data_dir() / "local"}
            config = StoreConfig.load(config, defaults=defaults, **overrides)
        elif overrides:
            try:
                config = StoreConfig(**{**config.model_dump(), **overrides})
            except ValidationError as e:
                raise ConfigError(f"invalid StoreConfig: {e}") from None
        return cls(LocalBackend(TieredStore(config)), codec=config.codec, lz4=config.lz4)

    @classmethod
    def connect(
        cls,
        url: str,
        token: str | None = None,
        codec: str = "raw",
        lz4: bool = False,
        codec_options: dict | None = None,
        check: bool = False,
        **options: Any,
    ) -> Store:
        """A store served by `kvstore-server` at `url`; `options` go to `kvstore.sdk.remote.RemoteBackend`
        (timeout=10 s a call waits for an answer, connect_timeout=3, retries=2 after connection errors
        and 502/503/504 but not after a timeout, retry_timeouts, pool_size, verify_tls,
        transport="auto"|"shm"|"tcp"|"http", shm_size, spin_us, read_index). `check=True` asks the server
        once now: a wrong URL, a server down or hung raises Unavailable, a missing or wrong token
        Unauthorized (otherwise the first call does)."""
        from kvstore.sdk.remote import RemoteBackend  # noqa: PLC0415 (the HTTP client is only needed here)

        backend = RemoteBackend(url, token=token, **options)
        if check:
            try:
                backend.check()
            except BaseException:
                backend.close()
                raise
        return cls(backend, codec=codec, lz4=lz4, codec_options=codec_options)

    # -- encoding (client side) -------------------------------------------------------------------------

    def encode(self, kv_or_blob: KVOrBlob, key: str | None = None) -> Outgoing:
        """A tensor becomes a blob with this store's codec, bound to `key`, not yet laid out: the backend
        writes it where it goes, once (kvstore.blob.PreparedBlob; a raw one reads the tensor then, so
        leave it unchanged until the put returns); a bytes-like (or a PreparedBlob) must already be a
        valid blob (the store verifies it on receipt: CorruptBlob and nothing stored)."""
        if isinstance(kv_or_blob, torch.Tensor):
            return prepare_blob(kv_or_blob, codec=self.codec, lz4=self.lz4, key=key, **self.codec_options)
        if isinstance(kv_or_blob, (bytes, bytearray, memoryview, PreparedBlob)):
            return kv_or_blob
        raise InvalidArgument(f"put takes a KV tensor or a blob, got {type(kv_or_blob).__name__}")

    def decode(
        self, key: str, blob: Blob | None, out: torch.Tensor | None = None, header: BlobHeader | None = None
    ) -> torch.Tensor | None:
        if blob is None:
            return None
        try:
            return decode_blob(blob, out=out, header=header, key=key)
        except CorruptBlob as e:  # locally the store has verified it; remote: damaged on the way
            logger.warning("blob %s does not decode (%s): treated as a miss", key, e)
            return None

    # -- sync --------------------------------------------------------------------------------------------

    def put(
        self, key: str, kv_or_blob: KVOrBlob, token_ids: TokenIds | None = None, parent: str | None = None
    ) -> list[str]:
        """Store a chunk; returns the tiers that hold it (NotStored / Unavailable if none does).
        `token_ids` (the chunk's tokens) and `parent` (the key of the chunk before it in its sequence,
        None for a first chunk) are hints for a kvstore-server's KV events, so that an indexer keyed by
        tokens (Dynamo's, llm-d's) indexes the chunk: never part of the key or of what is stored
        (kvstore.token_hints); InvalidArgument when they do not fit the chunk."""
        return self.backend.put_blob(key, self.encode(kv_or_blob, key), token_ids, parent)

    def get(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The KV tensor under `key` or None; `out` (right shape and dtype) receives it without allocating."""
        with self.backend.lease([key], in_place=True) as lease:
            kv = self.decode(key, lease.blobs[0], out, header=lease.headers[0])
            if lease.intact()[0]:
                return kv
        with self.backend.lease([key]) as lease:  # overwritten while decoded: ask the server
            return self.decode(key, lease.blobs[0], out, header=lease.headers[0])

    def get_blob(self, key: str) -> Blob | None:
        """The blob under `key` in a buffer the caller owns, or None; verify it before use."""
        return self.backend.get_blob(key)

    def lease_blobs(
        self, keys: Sequence[str], reasons: list[str | None] | None = None, in_place: bool = False
    ) -> BlobLease:
        """The blobs of `keys` (None for misses) lent until `release()`: no copy on the way to the caller
        (from a same-host server: its shared memory). `lease.headers[i]` is set where blob i was
        verified in this process already; a list given as `reasons` receives why each one missed.
        `in_place=True`: from a same-host server, without a request, where they lie in its arena; the
        server may overwrite them meanwhile, so check `lease.intact()` after use (sdk.buffers)."""
        return self.backend.lease(keys, reasons, in_place)

    def exists(self, key: str) -> bool:
        return self.backend.exists(key)

    def delete(self, key: str) -> bool:
        return self.backend.delete(key)

    def batch_put(
        self,
        items: Sequence[tuple[str, KVOrBlob]],
        replaces: Sequence[str] = (),
        token_ids: Sequence[TokenIds | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> list[list[str]]:
        """Store the chunks; then delete `replaces` (keys the new chunks supersede), only once every one
        is stored (a failed put deletes nothing): with a kvstore-server, in the same round trip.
        `token_ids` / `parents`: per item, `put`'s hints (or None)."""
        blobs = [(key, self.encode(x, key)) for key, x in items]
        return self.backend.batch_put(blobs, replaces, token_ids, parents)

    def batch_delete(self, keys: Sequence[str]) -> int:
        """Delete every key, in one round trip; how many were stored."""
        return self.backend.batch_delete(keys)

    def batch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        with self.backend.lease(keys, in_place=True) as lease:
            kvs = self._decode_all(keys, lease)
            torn = [i for i, whole in enumerate(lease.intact()) if not whole]
        if torn:  # overwritten while decoded: those again from the server
            with self.backend.lease([keys[i] for i in torn]) as lease:
                for i, kv in zip(torn, self._decode_all([keys[i] for i in torn], lease), strict=True):
                    kvs[i] = kv
        return kvs

    def _decode_all(self, keys: Sequence[str], lease: BlobLease) -> list[torch.Tensor | None]:
        return [self.decode(k, b, header=h) for k, b, h in zip(keys, lease.blobs, lease.headers, strict=True)]

    def batch_get_blobs(
        self, keys: Sequence[str], reasons: list[str | None] | None = None
    ) -> list[Blob | None]:
        """Blobs in key order (buffers the caller owns), None for misses; a list given as `reasons`
        receives why each one missed."""
        return self.backend.batch_get(keys, reasons)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.backend.batch_exists(keys)

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        """How many leading `keys` are stored (the first gap ends the run)."""
        return self.backend.lookup_prefix(keys)

    def lookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        """(`lookup_prefix(keys)`, why the next key is missing: not_stored, evicted, expired, corrupt or
        unreachable; None when every key is stored)."""
        return self.backend.lookup(keys)

    def lookup_and_exists(
        self, keys: Sequence[str], others: Sequence[str]
    ) -> tuple[int, str | None, list[bool]]:
        """`lookup(keys)` and `batch_exists(others)`, in one round trip to a kvstore-server (one that
        predates it answers in two): a prefix of full chunks and the candidates that may follow it."""
        return self.backend.lookup_and_exists(keys, others)

    def stats(self) -> dict[str, Any]:
        return self.backend.stats()

    def health(self) -> StoreHealth:
        """Whether the store answers (`reachable`) and accepts this client (`authorized`), its version,
        tiers and transport; never raises over a store that is down, hung or refusing the token."""
        return self.backend.health()

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- async -------------------------------------------------------------------------------------------
    # encoding and decoding move whole chunks (and lossy codecs are slow), so they leave the event loop

    async def aput(
        self, key: str, kv_or_blob: KVOrBlob, token_ids: TokenIds | None = None, parent: str | None = None
    ) -> list[str]:
        blob = await asyncio.to_thread(self.encode, kv_or_blob, key)
        return await self.backend.aput_blob(key, blob, token_ids, parent)

    async def aget(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        with await self.backend.alease([key]) as lease:
            return await asyncio.to_thread(self.decode, key, lease.blobs[0], out, lease.headers[0])

    async def aget_blob(self, key: str) -> Blob | None:
        return await self.backend.aget_blob(key)

    async def alease_blobs(self, keys: Sequence[str], reasons: list[str | None] | None = None) -> BlobLease:
        return await self.backend.alease(keys, reasons)

    async def aexists(self, key: str) -> bool:
        return await self.backend.aexists(key)

    async def adelete(self, key: str) -> bool:
        return await self.backend.adelete(key)

    async def abatch_put(
        self,
        items: Sequence[tuple[str, KVOrBlob]],
        replaces: Sequence[str] = (),
        token_ids: Sequence[TokenIds | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> list[list[str]]:
        blobs = await asyncio.to_thread(lambda: [(key, self.encode(x, key)) for key, x in items])
        return await self.backend.abatch_put(blobs, replaces, token_ids, parents)

    async def abatch_delete(self, keys: Sequence[str]) -> int:
        return await self.backend.abatch_delete(keys)

    async def abatch_get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        with await self.backend.alease(keys) as lease:
            return await asyncio.to_thread(self._decode_all, keys, lease)

    async def abatch_get_blobs(self, keys: Sequence[str]) -> list[Blob | None]:
        return await self.backend.abatch_get(keys)

    async def abatch_exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.backend.abatch_exists(keys)

    async def alookup_prefix(self, keys: Sequence[str]) -> int:
        return await self.backend.alookup_prefix(keys)

    async def alookup(self, keys: Sequence[str]) -> tuple[int, str | None]:
        return await self.backend.alookup(keys)

    async def astats(self) -> dict[str, Any]:
        return await self.backend.astats()

    async def ahealth(self) -> StoreHealth:
        return await self.backend.ahealth()

    async def aclose(self) -> None:
        await self.backend.aclose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
