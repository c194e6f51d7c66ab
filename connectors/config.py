"""`KVTransferConfig`: how the kvstore connector reaches its store and what it moves.

These are the fields of vLLM's `kv_connector_extra_config`, for vLLM and for `kvstore-engine
--kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {...}}'`. Layers, lowest first (kvstore.settings): defaults < YAML <
`KVSTORE_<FIELD>` environment < the mapping / flags. Build one with `from_mapping(extra)`; the engine
fills in `layout` and `block_size` (what its paged cache looks like) with `for_engine(...)`.

`store_url: local` is a tiered store inside this process: by default cpu only (gone when the engine
exits, so a restart gets no hits); `local_tiers: [cpu, disk]` keeps chunks in `local_disk_path`
(~/.cache/kvstore/data/engine) across restarts. `http(s)://host:port` is a kvstore-server, which
several engines share.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from kvstore.connectors.base import KV_ROLE_ALIASES
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvstore.config import StoreConfig, TierName, default_data_dir
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.keys import KVLayout
from kvstore.settings import Size, human_error, load_settings, read_token

logger = logging.getLogger(__name__)
KVRole = Literal["kv_both", "kv_producer", "kv_consumer"]  # vLLM's names (connectors.base.KV_ROLES)
KVCodec = Literal["raw", "fp8", "int4", "kivi4", "kivi2", "kivi4+ans", "kivi2+ans", "int4+ans", "fp8+ans"]
# the short names `kv_connector_extra_config` users write
SHORT_NAMES = {"url": "store_url", "token": "auth_token", "token_file": "auth_token_file"}


class KVTransferConfig(BaseModel):
    """Connector settings. `store_url` is `local` (an in-process tiered store) or `http(s)://host:port`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store_url: str = "local"
    # the kvstore-server's bearer token (prefer auth_token_file); never in a repr, a log line or an error
    auth_token: str | None = Field(None, repr=False)
    auth_token_file: Path | None = None
    codec: KVCodec = "raw"
    kv_role: KVRole = "kv_both"
    chunk_size: int = 256
    partial_chunks: bool = True  # store a finished request's last partial chunk for longer prompts
    namespace: str = ""
    # in-process store (store_url == "local")
    local_tiers: list[TierName] = Field(default_factory=lambda: ["cpu"])  # add disk to hit after restarts
    local_cpu_capacity: Size = 4 * 2**30
    local_disk_capacity: Size = 64 * 2**30
    local_disk_path: Path = Field(default_factory=lambda: default_data_dir() / "engine")
    # the local store's codec per tier, as kvstore-server's --tier-codec: "cpu=raw,disk=kivi4"
    local_tier_codec: dict[str, str] | str = Field(default_factory=dict)
    # background work
    save_threads: int = 1
    load_threads: int = 2
    max_pending_saves: int = 64  # chunks copied out and waiting for the store; beyond, saves are dropped
    load_async: bool = True  # loads run in the background: the request waits for them, others run
    lookup_timeout_s: float = 0.25  # a prefix lookup inside the engine step waits no longer: then a miss
    unreachable_backoff_s: float = 5.0  # after the store fails, skip it this long instead of retrying
    timeout_s: float = 10.0  # per request to a remote store
    retries: int = 1  # per request to a remote store, with backoff
    # filled by the engine
    layout: KVLayout | None = None
    block_size: int = 16
    # pipeline parallel: each stage's layers [a, b); its chunks are stored under kvstore.keys.stage_key
    pp_stages: tuple[tuple[int, int], ...] = ()

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise human_error(e, "KV transfer settings") from None

    @field_validator("kv_role", mode="before")
    @classmethod
    def _role(cls, v: Any) -> Any:
        return KV_ROLE_ALIASES.get(v, v) if isinstance(v, str) else v

    @field_validator("local_tiers", mode="before")
    @classmethod
    def _tiers(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [t.strip() for t in v.split(",") if t.strip()]
        return v

    @model_validator(mode="before")
    @classmethod
    def _layout_chunk_size(cls, data: Any) -> Any:
        """A layout given as a mapping without chunk_size gets the config's (the engine cannot know it)."""
        layout = data.get("layout") if isinstance(data, dict) else None
        if isinstance(layout, dict) and "chunk_size" not in layout:
            data = {**data, "layout": {**layout, "chunk_size": data.get("chunk_size", 256)}}
        return data

    @model_validator(mode="after")
    def _check(self) -> KVTransferConfig:
        if self.store_url != "local" and not self.store_url.startswith(("http://", "https://")):
            raise ValueError(f"store_url must be 'local' or http(s)://host:port, got {self.store_url!r}")
        for name in ("chunk_size", "block_size", "save_threads", "load_threads", "max_pending_saves"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("lookup_timeout_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.unreachable_backoff_s >= 0:  # the breaker's backoff (kvstore/breaker.py)
            raise ValueError(f"unreachable_backoff_s must be 0 or more, got {self.unreachable_backoff_s}")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size {self.chunk_size} must be a multiple of the engine block_size {self.block_size}"
            )
        if self.layout is not None and self.layout.chunk_size != self.chunk_size:
            raise ValueError(f"layout.chunk_size {self.layout.chunk_size} != chunk_size {self.chunk_size}")
        if not self.local_tiers or len(set(self.local_tiers)) != len(self.local_tiers):
            raise ValueError(f"local_tiers must be a non-empty list without repeats, got {self.local_tiers}")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError("give auth_token or auth_token_file, not both")
        return self

    @property
    def saves(self) -> bool:
        """A consumer (decode instance) only loads KV; kv_both and kv_producer save it."""
        return self.kv_role != "kv_consumer"

    @property
    def is_producer(self) -> bool:
        """kv_producer: a prefill instance (it saves the prompt's KV and stops after one token)."""
        return self.kv_role == "kv_producer"

    def token(self) -> str | None:
        """The bearer token for a kvstore-server, read from `auth_token_file` when one is given."""
        return read_token(self.auth_token, self.auth_token_file)

    @property
    def is_local(self) -> bool:
        return self.store_url == "local"

    def local_store_config(self) -> StoreConfig:
        return StoreConfig(
            tiers=list(self.local_tiers),
            cpu_capacity=self.local_cpu_capacity,
            disk_capacity=self.local_disk_capacity,
            disk_path=self.local_disk_path,
            tier_codec=self.local_tier_codec,
        )

    def for_engine(
        self,
        *,
        model_name: str,
        model_config_hash: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: str,
        block_size: int,
    ) -> KVTransferConfig:
        """A copy that knows the engine's cache layout (every chunk key depends on it)."""
        try:
            layout = KVLayout(
                model_name=model_name,
                model_config_hash=model_config_hash,
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                kv_dtype=kv_dtype,
                chunk_size=self.chunk_size,
            )
        except InvalidArgument as e:
            raise ConfigError(f"the engine's KV layout is invalid: {e}") from None
        return KVTransferConfig(**{**self.model_dump(), "layout": layout, "block_size": block_size})

    @classmethod
    def from_mapping(
        cls, extra: Mapping[str, Any] | None = None, env_prefix: str = "KVSTORE_"
    ) -> KVTransferConfig:
        """vLLM's `kv_connector_extra_config` (or any mapping of these fields; None values are ignored)
        over `KVSTORE_*` environment variables over the defaults. Also takes the short names `url`,
        `token`, `token_file`, and vLLM's role names (`kv_both`, `kv_producer`, `kv_consumer`)."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
        data: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            name = SHORT_NAMES.get(key, key)
            if name in data:
                raise ConfigError(f"{key!r} and {name!r} set the same thing; give one")
            data[name] = value
        stale = sorted(k for k in os.environ if k.startswith("KV_TRANSFER_"))
        if stale:
            logger.warning("ignoring %s: the connector reads KVSTORE_* variables now", ", ".join(stale))
        (config,) = load_settings([cls], None, data, env_prefix=env_prefix, use_config_env=False)
        return config

    @classmethod
    def load(
        cls, path: str | Path | None = None, env_prefix: str = "KVSTORE_", **overrides: Any
    ) -> KVTransferConfig:
        """Defaults < YAML file < KVSTORE_* environment < explicit overrides (None is ignored)."""
        (config,) = load_settings([cls], path, overrides, env_prefix=env_prefix, use_config_env=False)
        return config
