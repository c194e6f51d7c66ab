"""SGLang HiCache pages as kvstore blobs: geometry, keys, and one-copy moves (no SGLang import).

A page of SGLang's host pool holds `page_size` tokens of every layer. Whatever the pool's layout
(`layer_first`, `page_first`, `page_first_direct`, `page_head`), a page is stored as the engine-neutral
blob of docs/design.md §2: `[2, layers, tokens, kv_heads, head_dim]`, K then V. So a page stored by an
engine with one host layout loads into an engine with another, and the server's per-tier codecs
(which quantise keys per channel and values per token) see real K and V axes.

An MLA pool holds one latent row per token and layer (`kv_lora_rank + qk_rope_head_dim`, no K/V pair);
it is stored as `[2, layers, tokens, 1, row/2]`: the first half of each row in the "K" slot, the
second half in "V". Bit-exact with the raw codec; what a lossy tier codec does to a latent split this
way was not measured.

Moves (`PageView`): a page is a strided view of the host pool, never copied to a tensor of its own.
Backing one up lays the blob out where the SDK sends it (a same-host server's shared memory) in one
strided copy, hashed piece by piece as it is copied (`StridedBlob`); loading one copies a raw blob's
payload from where the SDK lent it (the server's arena, in place) straight into the pool's strided view.
Where that is not possible there is one intermediate tensor: a blob of another codec, or lz4-compressed
(decoded first), and the socket path to a server on another host (`StridedBlob.parts`: a contiguous copy).

Keys: SGLang hands the backend its own page hashes (a SHA-256 chain over the page's token ids), never
the tokens; kvstore's key of a page is `blake2b-128(root ‖ "sglang/page" ‖ field(shard) ‖ field(hash))`
with `root` the chunk-key root of docs/design.md §1 (namespace and layout fingerprint: model, config
hash, layers, heads, head dim, dtype, page size as the chunk size, TP rank and world size).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from kvstore.blob import (
    COMPRESSION_NONE,
    V1_HEADER_SIZE,
    BlobHeader,
    PreparedBlob,
    decode_blob,
    key_tag,
    verify_blob,
)
from kvstore.codecs.raw import RawCodec
from kvstore.errors import ConfigError, CorruptBlob, InvalidArgument
from kvstore.keys import DIGEST_SIZE, KVLayout, model_identity_hash, model_identity_name

logger = logging.getLogger(__name__)

# the blob header's checksum field (docs/design.md §2: offset 44, 8 bytes) and what it covers
_CHECK_AT = V1_HEADER_SIZE - 8
_U64 = struct.Struct("<Q")
_PIECE = 256 * 1024  # copied, then hashed while still in the CPU's cache (as kvstore.blob does)
# same-size integer dtypes: numpy has no bfloat16, and a strided copy only moves bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
KV_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
KV_DTYPES[torch.float8_e4m3fn] = "float8_e4m3fn"
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PageGeometry:
    """What one page of a host pool looks like: its shape in the pool (`host_shape`, what
    `get_data_page(i, flat=False)` returns) and as a blob (`shape`, `[2, L, T, H, D]`)."""

    kind: str  # "mha" or "mla"
    layout: str
    page_size: int
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    host_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.layers, self.page_size, self.heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def kv_dtype(self) -> str:
        return KV_DTYPES[self.dtype]

    def canonical(self, page: torch.Tensor) -> torch.Tensor:
        """`page` (one page as the pool holds it, `host_shape`) as a `[2, L, T, H, D]` view: no copy."""
        if tuple(page.shape) != self.host_shape:
            raise ConfigError(f"a page of {tuple(page.shape)}, the pool's are {self.host_shape}")
        if self.kind == "mha":
            if self.layout == "layer_first":  # [2, L, T, H, D]
                return page
            if self.layout == "page_first":  # [2, T, L, H, D]
                return page.permute(0, 2, 1, 3, 4)
            if self.layout == "page_first_direct":  # [2, 1, L, T, H, D]
                return page[:, 0]
            return page[:, 0].permute(0, 3, 2, 1, 4)  # page_head: [2, 1, H, T, L, D]
        if self.layout == "page_first":  # [T, L, 1, row]
            page = page.transpose(0, 1)
        elif self.layout == "page_first_direct":  # [1, L, T, 1, row]
            page = page[0]
        # [L, T, 1, row] -> [L, T, 1, 2, row/2] -> [2, L, T, 1, row/2]
        return page.unflatten(-1, (2, self.head_dim)).permute(3, 0, 1, 2, 4)

    def flat_view(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page (SGLang's generic page path: the pool's page order, flattened) as `[2, L, T, H, D]`."""
        if flat.numel() != math.prod(self.host_shape) or flat.dtype != self.dtype or not flat.is_contiguous():
            raise ConfigError(
                f"a flat page of {flat.numel()} {flat.dtype} values, the pool's hold "
                f"{math.prod(self.host_shape)} {self.dtype}"
            )
        return self.canonical(flat.view(self.host_shape))


def geometry_of(pool: Any) -> PageGeometry:
    """The page geometry of an SGLang host pool (`MHATokenToKVPoolHost` or `MLATokenToKVPoolHost`,
    read by duck typing); ConfigError for a pool this backend does not store."""
    kind = "mla" if hasattr(pool, "kv_cache_dim") else "mha"
    layout, dtype = getattr(pool, "layout", None), getattr(pool, "dtype", None)
    name = type(pool).__name__
    if getattr(pool, "dcp_size", 1) != 1:
        raise ConfigError(f"{name}: decode context parallel (dcp_size > 1) is not supported")
    if dtype not in KV_DTYPES:
        raise ConfigError(
            f"{name}: a {dtype} host pool is not supported (float16, bfloat16, float32, float8_e4m3fn; an "
            "fp8 cache SGLang keeps as uint8 does not say which fp8 it is)"
        )
    if not isinstance(getattr(pool, "kv_buffer", None), torch.Tensor):
        raise ConfigError(f"{name}: no single kv_buffer tensor (split K/V pools are not supported)")
    if pool.kv_buffer.device.type != "cpu":
        raise ConfigError(f"{name}: the host pool is on {pool.kv_buffer.device}, not in host memory")
    page_size, layers = int(pool.page_size), int(pool.layer_num)
    if kind == "mha":
        if layout not in MHA_LAYOUTS:
            raise ConfigError(f"{name}: host layout {layout!r} is not supported (one of {MHA_LAYOUTS})")
        if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
            raise ConfigError(f"{name}: K and V head dims differ ({pool.head_dim}, {pool.v_head_dim})")
        heads, head_dim = int(pool.head_num), int(pool.head_dim)
    else:
        if layout not in MLA_LAYOUTS:
            raise ConfigError(f"{name}: host layout {layout!r} is not supported (one of {MLA_LAYOUTS})")
        row = int(pool.kv_cache_dim)
        if row % 2:
            raise ConfigError(f"{name}: an MLA row of {row} values does not split in two halves")
        heads, head_dim = 1, row // 2
    host_shape = tuple(pool.get_data_page(0, flat=False).shape)
    geo = PageGeometry(kind, layout, page_size, layers, heads, head_dim, dtype, host_shape)
    geo.canonical(pool.get_data_page(0, flat=False))  # the shape checks out
    return geo


def page_layout(geo: PageGeometry, cfg: Any, model_path: str | None = None) -> KVLayout:
    """The layout fingerprint of a rank's pages (docs/design.md §1): the model's name and config hash, the
    pool's geometry, the page size as the chunk size, and the TP rank and size of SGLang's
    `HiCacheStorageConfig` (`cfg`); an MLA model's pages are every rank's, TP 0 of 1."""
    name = model_path or cfg.model_name or "unknown-model"
    config = model_config(name)
    if config is None:
        logger.warning(
            "KVStoreHiCacheStorage: no config.json found for %r (set model_path in the extra config): keys "
            "rest on the model's name and KV geometry alone",
            name,
        )
    tp_rank, tp_size = (0, 1) if cfg.is_mla_model else (cfg.tp_rank, cfg.tp_size)
    return KVLayout(
        model_name=model_identity_name(name),
        model_config_hash="" if config is None else model_identity_hash(config),
        num_layers=geo.layers,
        num_kv_heads=geo.heads,
        head_dim=geo.head_dim,
        kv_dtype=geo.kv_dtype,
        chunk_size=geo.page_size,
        tp_rank=tp_rank,
        tp_world_size=tp_size,
    )


def shard_of(cfg: Any) -> str:
    """What of a page a rank holds beyond the layout fingerprint: its pipeline stage (its layers) and
    its attention-context slice; "" for neither."""
    parts = []
    if cfg.pp_size > 1:
        parts.append(f"pp{cfg.pp_rank}/{cfg.pp_size}")
    if getattr(cfg, "attn_cp_size", 1) > 1:
        parts.append(f"cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}")
    return ",".join(parts)


def model_config(name: str) -> dict | None:
    """The model's config.json: in its directory, else in the Hugging Face cache (never downloaded)."""
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415

            found = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 (not a hub id, no hub library: no config)
            return None
        if not isinstance(found, str):
            return None
        path = Path(found)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def page_keys(root: bytes, shard: str, hashes: Sequence[str]) -> list[str]:
    """kvstore keys (32 hex characters) of SGLang page hashes under a layout's `root` and a `shard`
    ("" or e.g. "pp1/2": what the layout fingerprint does not say about which part of a page a rank has)."""
    prefix = root + b"sglang/page" + _field(shard.encode())
    return [hashlib.blake2b(prefix + _field(h.encode()), digest_size=DIGEST_SIZE).hexdigest() for h in hashes]


@functools.lru_cache(maxsize=8)
def _stand_in(n: int) -> mmap.mmap:
    """n bytes of address space never touched (no memory behind it): a payload of the right size for
    `PreparedBlob.of`, which reads only its length."""
    return mmap.mmap(-1, n)


def _field(b: bytes) -> bytes:
    return len(b).to_bytes(4, "little") + b


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of `t`'s memory, strides and all, as same-size integers."""
    return t.view(_BITS[t.dtype.itemsize]).numpy()


class StridedBlob(PreparedBlob):
    """A raw blob whose payload is a strided view of the host pool: laid out where it goes (`write_into`)
    in one copy, each piece hashed right after it is copied. Stands wherever the SDK takes a
    `PreparedBlob`; `parts` (a socket) makes a contiguous copy first."""

    def __init__(self, view: torch.Tensor, key: str) -> None:
        n = math.prod(view.shape) * view.dtype.itemsize
        proto = PreparedBlob.of(
            0, COMPRESSION_NONE, view.dtype, tuple(view.shape), {}, _stand_in(n), key_tag(key)
        )
        super().__init__(proto.head, memoryview(b""))  # kvstore.blob laid the header out
        object.__setattr__(self, "source", _bits(view))

    @property
    def nbytes(self) -> int:
        return len(self.head) + self.source.nbytes

    def _finish(self, h: xxhash.xxh3_64) -> bytes:
        return self.head[:_CHECK_AT] + _U64.pack(h.intdigest()) + self.head[V1_HEADER_SIZE:]

    def _hasher(self) -> xxhash.xxh3_64:
        h = xxhash.xxh3_64(self.head[:_CHECK_AT])
        h.update(self.head[V1_HEADER_SIZE:])
        return h

    def parts(self) -> list[bytes | memoryview]:
        payload = memoryview(np.ascontiguousarray(self.source)).cast("B")
        h = self._hasher()
        h.update(payload)
        return [self._finish(h), payload]

    def to_bytes(self) -> bytes:
        return b"".join(self.parts())

    def write_into(self, out: bytearray | memoryview) -> None:
        d = memoryview(out).cast("B")
        if len(d) != self.nbytes:
            raise InvalidArgument(f"a {self.nbytes}-byte blob does not fit {len(d)} bytes")
        n, src = len(self.head), self.source
        dst = np.frombuffer(d, np.uint8, src.nbytes, n).view(src.dtype).reshape(src.shape)
        h = self._hasher()
        per_layer = src[0, 0].nbytes
        step = max(1, _PIECE // per_layer)  # layers per piece
        pos = n
        for kv in range(2):
            for a in range(0, src.shape[1], step):
                b = min(a + step, src.shape[1])
                np.copyto(dst[kv, a:b], src[kv, a:b])
                h.update(d[pos : pos + (b - a) * per_layer])
                pos += (b - a) * per_layer
        d[:n] = self._finish(h)


def load_into(dst: torch.Tensor, blob: Any, header: BlobHeader | None, key: str) -> None:
    """Copy the blob of `key` into `dst` (a `[2, L, T, H, D]` view of the host pool, any strides).
    A raw uncompressed blob goes from where it lies straight into the view; any other codec is decoded
    first (one intermediate tensor). `header`: the blob's, when the SDK verified or parsed it already
    (else it is verified here). Raises CorruptBlob (a miss) for a blob that does not verify or holds
    another shape or dtype."""
    if header is None:
        header = verify_blob(blob, key=key)
    header.check_key(key)
    if header.shape != tuple(dst.shape) or header.dtype != dst.dtype:
        raise CorruptBlob(
            f"the blob holds {header.shape} {header.dtype}, the page is {tuple(dst.shape)} {dst.dtype}"
        )
    if header.codec_id == RawCodec.codec_id and header.compression == COMPRESSION_NONE:
        out = _bits(dst)
        payload = memoryview(blob).cast("B")[header.payload_offset :]
        np.copyto(out, np.frombuffer(payload, out.dtype).reshape(out.shape))
        return
    dst.copy_(decode_blob(blob, header=header, key=key))
