"""Engine arguments (vLLM's EngineArgs names), shared by the LLM API, the CLI and the server.

The KV connector is configured the way vLLM's is: `kv_transfer_config` (`--kv-transfer-config JSON`)
`{"kv_connector": "KVStoreConnector", "kv_role": "kv_both|kv_producer|kv_consumer",
"kv_connector_extra_config": {...connectors.config.KVTransferConfig fields...}}`. The older flags stay
as shorthands: `--kv-backend kvstore`, `--kv-role both|prefill|decode` (vLLM's kv_both, kv_producer,
kv_consumer), and `--kv-store-url`, `--kv-codec`, `--kv-store-token-file` for the extra config's
`store_url`, `codec`, `auth_token_file` (a flag wins over the JSON). What neither sets comes from
`KVSTORE_*` environment variables, read by the connector itself.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvstore.connectors.base import canonical_kv_role
from kvstore.connectors.factory import KV_BACKENDS, backend_for_connector
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.kv_cache.spec import KV_CACHE_DTYPES, KV_SCALE_GRANULARITIES

from kvstore.errors import KVStoreError
from kvstore.settings import load_settings
from kvstore.settings import parse_size as _parse_size

KV_CODECS = ("raw", "fp8", "int4", "kivi4", "kivi2", "kivi4+ans", "kivi2+ans", "int4+ans", "fp8+ans")
KV_ROLES = ("both", "prefill", "decode", "kv_both", "kv_producer", "kv_consumer")
KV_TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
DTYPES = ("auto", "float32", "float16", "bfloat16")


def parse_size(value: int | str) -> int:
    """Bytes, with pydantic ByteSize rules like every kvstore setting ('512MiB', '2GiB', '500MB')."""
    try:
        return _parse_size(value)
    except KVStoreError as e:
        raise InvalidRequest(str(e)) from None


def parse_kv_transfer_config(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's --kv-transfer-config (JSON text or a mapping), checked for the keys this engine uses."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequest(f"--kv-transfer-config is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise InvalidRequest("--kv-transfer-config must be a JSON object")
    unknown = sorted(set(value) - set(KV_TRANSFER_KEYS))
    if unknown:
        raise InvalidRequest(
            f"--kv-transfer-config: kvstore-engine does not use {', '.join(unknown)} "
            f"(it reads {', '.join(KV_TRANSFER_KEYS)})"
        )
    if "kv_connector" not in value:
        raise InvalidRequest('--kv-transfer-config needs "kv_connector": "KVStoreConnector"')
    extra = value.get("kv_connector_extra_config") or {}
    if not isinstance(extra, Mapping):
        raise InvalidRequest("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
    return {**value, "kv_connector_extra_config": dict(extra)}


@dataclass
class EngineArgs:
    # an HF model directory, or "smollm2" (converted on first use, see kvstore.engine.convert)
    model: str = "smollm2"
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    kv_cache_memory: int | str = "512MiB"
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    # auto: bfloat16 on CPU (kvstore.engine.config.resolve_dtype); float32 = the exact reference
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), bfloat16, float16, float32, fp8 (e4m3)
    kv_scale_granularity: str = "head"  # fp8: a calibrated scale per KV head, or per layer ("tensor")
    device: str = "cpu"
    enable_prefix_caching: bool = True
    kv_transfer_config: str | dict | None = None  # vLLM's KVTransferConfig as JSON text or a mapping
    kv_backend: str | None = None  # none | kvstore; default kvstore when a KV setting is given
    kv_store_url: str | None = None  # "local" (in-process cpu,disk store) or a kvstore-server URL
    kv_codec: str | None = None  # how saved KV is encoded: raw (bit-exact), fp8, int4
    kv_role: str | None = None  # vLLM's kv_both (default), kv_producer, kv_consumer, or both/prefill/decode
    kv_store_token_file: str | None = None  # the kvstore-server's bearer token
    num_threads: int | None = None  # torch intra-op threads; default 1 (see llm_engine.default_num_threads)
    served_model_name: str | None = None
    kv_events_config: str | dict | None = None  # vLLM's KVEventsConfig as JSON text or a mapping (off)

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
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequest(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_scale_granularity not in KV_SCALE_GRANULARITIES:
            raise InvalidRequest(
                f"kv_scale_granularity must be one of {KV_SCALE_GRANULARITIES}, got {self.kv_scale_granularity!r}"
            )
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise InvalidRequest("model must be a model directory or 'smollm2'")
        self.model = str(self.model)
        self._resolve_kv_transfer()

    def _resolve_kv_transfer(self) -> None:
        """One connector setup from --kv-transfer-config and the shorthand flags."""
        ktc = parse_kv_transfer_config(self.kv_transfer_config)
        if self.kv_backend is not None and self.kv_backend not in KV_BACKENDS:
            raise InvalidRequest(f"kv_backend must be one of {KV_BACKENDS}, got {self.kv_backend!r}")
        if self.kv_codec is not None and self.kv_codec not in KV_CODECS:
            raise InvalidRequest(f"kv_codec must be one of {KV_CODECS}, got {self.kv_codec!r}")
        if self.kv_store_url is not None and (
            not isinstance(self.kv_store_url, str) or not self.kv_store_url
        ):
            raise InvalidRequest("kv_store_url must be 'local' or a kvstore-server URL")
        shorthands = {"store_url": self.kv_store_url, "codec": self.kv_codec,
                      "auth_token_file": self.kv_store_token_file}  # fmt: skip
        given = {k: v for k, v in shorthands.items() if v is not None}
        backend = self.kv_backend
        if ktc:
            try:
                wanted = backend_for_connector(ktc["kv_connector"])
            except KVStoreError as e:
                raise InvalidRequest(f"--kv-transfer-config: {e}") from None
            if backend not in (None, wanted):
                raise InvalidRequest(f"--kv-backend {backend} contradicts kv_connector {ktc['kv_connector']}")
            backend = wanted
        elif backend is None:
            backend = "kvstore" if given or self.kv_role is not None else "none"
        if backend == "none" and (given or self.kv_role is not None):
            raise InvalidRequest(f"{', '.join(sorted(given)) or 'kv_role'} needs --kv-backend kvstore")
        roles = set()
        for r in (self.kv_role, ktc.get("kv_role")):
            if r is not None:
                try:
                    roles.add(canonical_kv_role(r))
                except ValueError as e:
                    raise InvalidRequest(str(e)) from None
        if len(roles) > 1:
            raise InvalidRequest(
                f"--kv-role {self.kv_role} contradicts kv_transfer_config's {ktc['kv_role']}"
            )
        self.kv_backend = backend
        self.kv_role = (roles.pop() if roles else "kv_both") if backend != "none" else None

    @property
    def kv_connector_extra_config(self) -> dict[str, Any]:
        """What the connector gets (KVTransferConfig fields): the JSON's extra config, then the flags."""
        ktc = parse_kv_transfer_config(self.kv_transfer_config)
        shorthands = {"store_url": self.kv_store_url, "codec": self.kv_codec,
                      "auth_token_file": self.kv_store_token_file}  # fmt: skip
        return {
            **ktc.get("kv_connector_extra_config", {}),
            **{k: v for k, v in shorthands.items() if v is not None},
        }

    @property
    def kv_producer(self) -> bool:
        """A prefill instance: it saves the prompt's KV and stops after the first token."""
        return self.kv_backend != "none" and self.kv_role == "kv_producer"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Every flag defaults to None, so a `--config` file (or $KVSTORE_CONFIG) shows through."""
        parser.add_argument(
            "--config", metavar="FILE", help="YAML file of engine settings (these flags' names, e.g. "
            "'max_model_len: 2048'); flags win over it. Default: $KVSTORE_CONFIG if set",
        )  # fmt: skip
        p = parser.add_argument_group("engine")
        p.add_argument("--model", help="HF model directory, or 'smollm2' (default; converted on first use)")
        p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
        p.add_argument("--num-kv-blocks", type=int, help="KV cache blocks (overrides --kv-cache-memory)")
        p.add_argument("--kv-cache-memory", help="KV cache size, e.g. 512MiB (default) or 2GiB")
        p.add_argument("--max-num-batched-tokens", type=int, help="tokens per engine step (default 1024)")
        p.add_argument("--max-num-seqs", type=int, help="requests per batch (default 64)")
        p.add_argument("--max-model-len", type=int, help="default: the model's, at most 8192")
        p.add_argument("--dtype", choices=DTYPES,
                       help="weights: auto (default; bfloat16 on CPU) or float32 (token-identical to "
                       "transformers fp32)")  # fmt: skip
        p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                       help="what the paged KV cache stores: auto (default: the model dtype) or fp8 (e4m3, "
                       "half the memory)")  # fmt: skip
        p.add_argument("--kv-scale-granularity", choices=KV_SCALE_GRANULARITIES,
                       help="fp8 KV cache: a calibrated scale per KV head (default) or per layer (tensor)")  # fmt: skip
        p.add_argument("--device", help="default cpu")
        p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       default=None)  # fmt: skip
        p.add_argument("--num-threads", type=int, help="torch threads (default 1)")
        p.add_argument("--served-model-name", help="the model name in the API (default: the model's)")
        p.add_argument(
            "--kv-events-config", metavar="JSON",
            help="publish prefix-cache events as vLLM does (off by default), vLLM's KVEventsConfig: "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc:///tmp/engine-events", '
            '"replay_endpoint": "ipc:///tmp/engine-events-replay"}\'; the events hold prompts\' token ids: '
            'off this host, give "token_file" (CURVE: only holders of the token read them)',
        )  # fmt: skip
        k = parser.add_argument_group("KV store (vLLM's --kv-transfer-config, or the shorthands below)")
        k.add_argument(
            "--kv-transfer-config", metavar="JSON",
            help='e.g. \'{"kv_connector": "KVStoreConnector", "kv_role": "kv_both", '
            '"kv_connector_extra_config": {"store_url": "http://127.0.0.1:8100", "codec": "int4"}}\'',
        )  # fmt: skip
        k.add_argument(
            "--kv-backend", choices=KV_BACKENDS, help="kvstore: reuse KV through a store (default none)"
        )
        k.add_argument(
            "--kv-store-url",
            help="'local' (default): a cpu store inside this process, gone when it exits (a restart gets "
            'no hits; add disk with kv_connector_extra_config {"local_tiers": ["cpu", "disk"]} '
            "or KVSTORE_LOCAL_TIERS=cpu,disk: ~/.cache/kvstore/data/engine); or a kvstore-server "
            "http(s)://host:port that engines share and that outlives them",
        )
        k.add_argument(
            "--kv-store-token-file", metavar="FILE", help="file holding the kvstore-server's token"
        )
        k.add_argument(
            "--kv-codec",
            choices=KV_CODECS,
            help="encoding of saved KV: raw, fp8, int4, kivi4, kivi2 (each lossy one also +ans)",
        )
        k.add_argument(
            "--kv-role", choices=KV_ROLES,
            help="kv_both (default), kv_producer = prefill, kv_consumer = decode (disaggregated serving)",
        )  # fmt: skip

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """Defaults < YAML (--config, else $KVSTORE_CONFIG) < flags."""
        flags = {f.name: getattr(ns, f.name) for f in fields(cls) if f.init and hasattr(ns, f.name)}
        try:
            (args,) = load_settings([cls], getattr(ns, "config", None), flags, env_prefix=None)
        except KVStoreError as e:  # a config file that cannot be read, or an unknown setting in it
            raise InvalidRequest(str(e)) from None
        return args
