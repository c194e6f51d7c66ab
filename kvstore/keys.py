"""Chunk keys: prefix-chained, deterministic, versioned (docs/design.md §1).

A key never depends on the process, the machine, PYTHONHASHSEED or the codec. Recomputing one by hand:

    field(b)  = len(b) as little-endian uint32 ‖ b
    root      = blake2b-128( field(b"kvstore/v1") ‖ field(namespace utf-8) ‖ field(layout.fingerprint()) )
    key_i     = blake2b-128( key_{i-1} ‖ tokens_i as little-endian int32 ‖ extra )      key_{-1} = root
    partial   = blake2b-128( key_{i-1} ‖ b"partial" ‖ uint32 n ‖ tokens as little-endian int32 ‖ extra )
    stage     = blake2b-128( key ‖ b"layers" ‖ uint32 first ‖ uint32 end )     (pipeline parallel only)

`layout.fingerprint()` is the UTF-8 JSON of the layout fields with sorted keys and no spaces (an
empty `kv_scales` or `kv_format`, the usual case, is left out). Keys are 16 raw bytes, printed as 32 lowercase hex
characters. Changing any of this is a new KEY_VERSION.

Every engine builds its layout with `KVLayout.for_model` (or `model_layout` when the chunk size is
filled in later), from the model's own config.json, so KV computed by one engine (the bundled one, vLLM)
is a hit for the other whenever model, KV dtype, chunk size and tensor-parallel rank/world match.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument, InvalidKey

KEY_VERSION = "kvstore/v1"
DIGEST_SIZE = 16
_KEY_RE = re.compile(r"[0-9a-f]{32,128}")  # always fullmatch: `$` would accept a trailing "\n"
KV_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
# KVLayout.kv_format: "" is K and V per KV head; "mla" is one latent vector per token and layer (an MLA
# model's compressed KV: kv_lora_rank + qk_rope_head_dim wide, num_kv_heads 1, the same on every TP rank)
KV_FORMATS = ("", "mla")
# config.json keys that change when a tool re-saves the same model (and `_name_or_path`-style keys,
# which start with "_"): never part of a model's identity, so the same weights keep their KV keys.
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "use_cache"})


@dataclass(frozen=True)
class KVLayout:
    """Everything that makes two KV caches interchangeable. Part of every key."""

    model_name: str
    model_config_hash: str  # hash of the model's config (see `config_hash`), not of the weights file path
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "float16"
    chunk_size: int = 256
    tp_rank: int = 0
    tp_world_size: int = 1
    # fp8 KV: the engine's scale scheme and a digest of its scales ("head:<hex>"); values quantised
    # with other scales must never share keys. Empty for unscaled dtypes (and absent from the
    # fingerprint then, so those keys are unchanged).
    kv_scales: str = ""
    # what one token's KV is (KV_FORMATS); empty (K and V per head) is absent from the fingerprint
    kv_format: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_size", "tp_world_size"):
            if int(getattr(self, name)) <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise InvalidArgument(f"tp_rank {self.tp_rank} outside tp_world_size {self.tp_world_size}")
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidArgument(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_format not in KV_FORMATS:
            raise InvalidArgument(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")

    def fingerprint(self) -> bytes:
        fields = asdict(self)
        for name in ("kv_scales", "kv_format"):  # empty: absent, so the keys of older layouts stay
            if not fields[name]:
                del fields[name]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def for_model(
        cls,
        config: Mapping[str, Any],
        *,
        model: str,
        kv_dtype: str,
        chunk_size: int,
        tp_rank: int = 0,
        tp_world_size: int = 1,
        kv_scales: str = "",
        mla: bool = False,
    ) -> KVLayout:
        """The layout of `model`'s KV cache from its config.json; see `model_layout`."""
        fields = model_layout(
            config, model=model, kv_dtype=kv_dtype, tp_rank=tp_rank, tp_world_size=tp_world_size,
            kv_scales=kv_scales, mla=mla,
        )  # fmt: skip
        return cls(**fields, chunk_size=chunk_size)


def model_identity_name(model: str) -> str:
    """The name part of a model's identity: the last component of its path or hub id, so
    `/models/SmolLM2-135M-Instruct/` and `HuggingFaceTB/SmolLM2-135M-Instruct` both give
    `SmolLM2-135M-Instruct` (the config hash tells apart different models of the same name)."""
    name = str(model).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    if not name:
        raise InvalidArgument(f"no model name in {model!r}")
    return name


def model_identity_hash(config: Mapping[str, Any]) -> str:
    """`config_hash` of a model's config.json without its volatile keys (`VOLATILE_CONFIG_KEYS`)."""
    return config_hash(
        {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    )


def model_layout(
    config: Mapping[str, Any],
    *,
    model: str,
    kv_dtype: str,
    tp_rank: int = 0,
    tp_world_size: int = 1,
    kv_scales: str = "",
    mla: bool = False,
) -> dict[str, Any]:
    """Every `KVLayout` field but `chunk_size`, computed the same way for every engine.

    `config` is the model's config.json as read from disk (not a library's config object, which adds
    defaults that vary by version); `kv_dtype` the dtype of the KV cache (`torch.bfloat16` or
    `"bfloat16"`), and an fp8 cache's `kv_scales` digest. Under tensor parallelism each rank holds
    `num_key_value_heads / tp_world_size` KV heads (at least one; a rank replicates a head when
    there are more ranks than heads). `mla`: the engine keeps an MLA model's latent KV (one vector of
    `kv_lora_rank + qk_rope_head_dim` per token and layer, the same on every rank): kv_format "mla".
    """
    text = config.get("text_config") if "num_hidden_layers" not in config else None
    geo = text if isinstance(text, Mapping) else config
    try:
        heads = int(geo["num_attention_heads"])
        kv_heads = int(geo.get("num_key_value_heads") or heads)
        head_dim = int(geo.get("head_dim") or int(geo["hidden_size"]) // heads)
        layers = int(geo["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise InvalidArgument(f"the model config lacks a KV geometry field: {e!r}") from None
    if tp_world_size <= 0:
        raise InvalidArgument(f"tp_world_size must be positive, got {tp_world_size}")
    if mla:
        try:
            head_dim = int(geo["kv_lora_rank"]) + int(geo["qk_rope_head_dim"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(
                f"an MLA model config needs kv_lora_rank and qk_rope_head_dim: {e!r}"
            ) from None
        kv_heads, tp_world_size, tp_rank = 1, 1, 0  # one latent, whole on every rank
    return {
        "model_name": model_identity_name(model),
        "model_config_hash": model_identity_hash(config),
        "num_layers": layers,
        "num_kv_heads": max(1, kv_heads // tp_world_size),
        "head_dim": head_dim,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "tp_rank": tp_rank,
        "tp_world_size": tp_world_size,
        **({"kv_scales": kv_scales} if kv_scales else {}),
        **({"kv_format": "mla"} if mla else {}),
    }


def config_hash(config: dict) -> str:
    """A stable hash of a model's config.json contents (key order does not matter)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(blob, digest_size=DIGEST_SIZE).hexdigest()


def _field(b: bytes) -> bytes:
    return len(b).to_bytes(4, "little") + b


def _tokens_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise InvalidArgument("token ids must fit in int32")
    return arr.astype("<i4", copy=False).tobytes()


def root_key(layout: KVLayout, namespace: str = "") -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(_field(KEY_VERSION.encode()) + _field(namespace.encode()) + _field(layout.fingerprint()))
    return h.digest()


def hash_block(parent: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> bytes:
    """One link of the chain. The engine hashes its blocks with this too."""
    return hashlib.blake2b(parent + _tokens_bytes(tokens) + extra, digest_size=DIGEST_SIZE).digest()


def hash_partials(
    parent: bytes, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int], extra: bytes = b""
) -> list[bytes]:
    """Keys of the partial chunks (fewer than chunk_size tokens) after `parent` holding the first n
    of `tokens`, for each n in `lengths`; the length is part of the key."""
    body = _tokens_bytes(tokens)
    out = []
    for n in lengths:
        assert 0 < n <= len(body) // 4, (n, len(body) // 4)
        data = parent + b"partial" + n.to_bytes(4, "little") + body[: 4 * n] + extra
        out.append(hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest())
    return out


def stage_key(key: str, first_layer: int, end_layer: int) -> str:
    """The key of layers `[first_layer, end_layer)` of the chunk (or partial chunk) stored under `key`,
    for an engine split by pipeline parallelism: each stage stores its own layers under this key
    (an engine in one piece stores them all under `key` itself)."""
    if not 0 <= first_layer < end_layer < 2**32:
        raise InvalidArgument(f"bad layer range [{first_layer}, {end_layer})")
    data = bytes.fromhex(validate_key(key)) + b"layers" + first_layer.to_bytes(4, "little")
    return hashlib.blake2b(data + end_layer.to_bytes(4, "little"), digest_size=DIGEST_SIZE).hexdigest()


def chunk_keys(
    tokens: Sequence[int] | np.ndarray, layout: KVLayout, namespace: str = "", extra: bytes = b""
) -> list[str]:
    """Hex keys of every full `layout.chunk_size` chunk of `tokens`, in order."""
    arr = np.asarray(tokens)
    n = layout.chunk_size
    parent = root_key(layout, namespace)
    keys = []
    for i in range(len(arr) // n):
        parent = hash_block(parent, arr[i * n : (i + 1) * n], extra)
        keys.append(parent.hex())
    return keys


def partial_key(
    tokens: Sequence[int] | np.ndarray, layout: KVLayout, namespace: str = "", extra: bytes = b""
) -> str | None:
    """Key of the trailing partial chunk (None when `tokens` ends on a chunk boundary)."""
    arr = np.asarray(tokens)
    n = layout.chunk_size
    full = len(arr) // n
    tail = arr[full * n :]
    if len(tail) == 0:
        return None
    keys = chunk_keys(arr[: full * n], layout, namespace, extra)
    parent = bytes.fromhex(keys[-1]) if keys else root_key(layout, namespace)
    return hash_partials(parent, tail, [len(tail)], extra)[0].hex()


def is_key(text: object) -> bool:
    """Whether `text` is exactly a key: 32-128 lowercase hex characters, nothing before or after.
    The one key parser: HTTP paths, batch frames, JSON key lists and disk file names all use it."""
    return isinstance(text, str) and _KEY_RE.fullmatch(text) is not None


def validate_key(key: str) -> str:
    """Return `key` if it is exactly a key (`is_key`), else raise InvalidKey."""
    if not is_key(key):
        raise InvalidKey(f"a key is 32-128 lowercase hex characters, got {key!r:.80}")
    return key
