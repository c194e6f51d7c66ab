"""Engine arguments (vLLM's EngineArgs names), shared by the LLM API, the CLI and the server."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from engine.errors import InvalidRequest

KV_BACKENDS = ("none", "kvstore")
KV_CODECS = ("raw", "fp8", "int4")
KV_ROLES = ("both", "prefill", "decode")
DTYPES = ("auto", "float32", "float16", "bfloat16")


def parse_size(value: int | str) -> int:
    """'512MiB' / '2GiB' / '1000000' -> bytes."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().removesuffix("b")
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            try:
                return int(float(text[: -len(suffix)]) * units[suffix])
            except ValueError:
                break
    try:
        return int(text)
    except ValueError:
        raise InvalidRequest(f"not a size: {value!r} (examples: 512MiB, 2GiB, 1000000)") from None


@dataclass
class EngineArgs:
    model: str  # an HF model directory, or "smollm2" (converted on first use, see engine.convert)
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    kv_cache_memory: int | str = "512MiB"
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    dtype: str = "float32"
    device: str = "cpu"
    enable_prefix_caching: bool = True
    kv_backend: str = "none"
    kv_store_url: str = "local"  # with kv_backend kvstore: "local" (in-process store) or a kvstore-server URL
    kv_codec: str = "raw"  # how saved KV is encoded: raw (bit-exact), fp8, int4
    kv_role: str = "both"  # prefill: compute + save the prompt KV, stop after one token; decode: load only
    num_threads: int | None = None  # torch intra-op threads; default 1 (see llm_engine.default_num_threads)
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise InvalidRequest(f"{name} must be a positive int, got {v!r}")

        for name in (
            "block_size",
            "num_kv_blocks",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
        ):
            positive(name)
        positive("num_threads")
        if self.block_size & (self.block_size - 1):
            raise InvalidRequest(f"block_size must be a power of two, got {self.block_size}")
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.kv_cache_memory <= 0:
            raise InvalidRequest("kv_cache_memory must be positive")
        if self.dtype not in DTYPES:
            raise InvalidRequest(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_backend not in KV_BACKENDS:
            raise InvalidRequest(f"kv_backend must be one of {KV_BACKENDS}, got {self.kv_backend!r}")
        if self.kv_codec not in KV_CODECS:
            raise InvalidRequest(f"kv_codec must be one of {KV_CODECS}, got {self.kv_codec!r}")
        if self.kv_role not in KV_ROLES:
            raise InvalidRequest(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_store_url, str) or not self.kv_store_url:
            raise InvalidRequest("kv_store_url must be 'local' or a kvstore-server URL")
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise InvalidRequest("model must be a model directory or 'smollm2'")
        self.model = str(self.model)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        p = parser.add_argument_group("engine")
        p.add_argument("--model", default="smollm2", help="HF model directory, or 'smollm2' (default)")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--num-kv-blocks", type=int, default=None)
        p.add_argument("--kv-cache-memory", default="512MiB", help="KV cache size, e.g. 512MiB")
        p.add_argument("--max-num-batched-tokens", type=int, default=1024)
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--dtype", choices=DTYPES, default="float32")
        p.add_argument("--device", default="cpu")
        p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
        p.add_argument(
            "--kv-backend", choices=KV_BACKENDS, default="none", help="kvstore: reuse KV via a store"
        )
        p.add_argument("--kv-store-url", default="local", help="'local' (in-process) or http://host:port")
        p.add_argument("--kv-codec", choices=KV_CODECS, default="raw", help="encoding of saved KV")
        p.add_argument("--kv-role", choices=KV_ROLES, default="both", help="prefill/decode disaggregation")
        p.add_argument("--num-threads", type=int, default=None)
        p.add_argument("--served-model-name", default=None)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
