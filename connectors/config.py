"""`KVTransferConfig`: how the kvstore connector reaches its store and what it moves (vLLM's
`--kv-transfer-config`, for this engine).

User-facing fields come from engine flags (`--kv-store-url`, `--kv-codec`, `--kv-role`), YAML or
`KV_TRANSFER_*` environment variables. The engine fills in `layout` and `block_size` (what the paged
cache looks like) with `for_engine(...)` before it creates the connectors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvstore.config import StoreConfig, TierName, default_data_dir, load_layers, parse_size
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.keys import KVLayout

KVRole = Literal["both", "prefill", "decode"]
KVCodec = Literal["raw", "fp8", "int4"]
# vLLM's `kv_role` names for ours, and the short names `kv_connector_extra_config` users write
VLLM_ROLES: dict[str, KVRole] = {"kv_both": "both", "kv_producer": "prefill", "kv_consumer": "decode"}
SHORT_NAMES = {"url": "store_url", "token": "auth_token"}


class KVTransferConfig(BaseModel):
    """Connector settings. `store_url` is `local` (an in-process tiered store) or `http(s)://host:port`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store_url: str = "local"
    auth_token: str | None = None
    codec: KVCodec = "raw"
    kv_role: KVRole = "both"
    chunk_size: int = 256
    namespace: str = ""
    # in-process store (store_url == "local")
    local_tiers: list[TierName] = Field(default_factory=lambda: ["cpu"])
    local_cpu_capacity: int = 4 * 2**30
    local_disk_capacity: int = 64 * 2**30
    local_disk_path: Path = Field(default_factory=lambda: default_data_dir() / "connector-disk")
    # background work
    save_threads: int = 1
    load_threads: int = 2
    max_pending_saves: int = 64  # chunks copied out and waiting for the store; beyond, saves are dropped
    load_async: bool = False  # True: loads finish in the background, reported by get_finished
    unreachable_backoff_s: float = 5.0  # after the store fails, skip it this long instead of retrying
    timeout_s: float = 10.0  # per request to a remote store
    retries: int = 1  # per request to a remote store, with backoff
    # filled by the engine
    layout: KVLayout | None = None
    block_size: int = 16

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(f"invalid KVTransferConfig: {e}") from None

    @field_validator("local_cpu_capacity", "local_disk_capacity", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

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
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size {self.chunk_size} must be a multiple of the engine block_size {self.block_size}"
            )
        if self.layout is not None and self.layout.chunk_size != self.chunk_size:
            raise ValueError(f"layout.chunk_size {self.layout.chunk_size} != chunk_size {self.chunk_size}")
        if not self.local_tiers or len(set(self.local_tiers)) != len(self.local_tiers):
            raise ValueError(f"local_tiers must be a non-empty list without repeats, got {self.local_tiers}")
        return self

    @property
    def saves(self) -> bool:
        """A decode instance only consumes KV (vLLM's kv_consumer); the others produce it."""
        return self.kv_role != "decode"

    @property
    def is_local(self) -> bool:
        return self.store_url == "local"

    def local_store_config(self) -> StoreConfig:
        return StoreConfig(
            tiers=list(self.local_tiers),
            cpu_capacity=self.local_cpu_capacity,
            disk_capacity=self.local_disk_capacity,
            disk_path=self.local_disk_path,
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
    def from_mapping(cls, settings: Mapping[str, Any]) -> KVTransferConfig:
        """Settings as one mapping (vLLM's `kv_connector_extra_config`) layered over the environment
        (`load`): field names, the short names `url` and `token`, `token_file` (a file holding the
        token), and vLLM's role names (`kv_both`, `kv_producer`, `kv_consumer`)."""
        data: dict[str, Any] = {}
        for key, value in settings.items():
            name = SHORT_NAMES.get(key, key)
            if name in data:
                raise ConfigError(f"{key!r} and {name!r} set the same thing; give one")
            data[name] = value
        token_file = data.pop("token_file", None)
        if token_file is not None:
            if data.get("auth_token") is not None:
                raise ConfigError("give token or token_file, not both")
            data["auth_token"] = read_token_file(token_file)
        if data.get("kv_role") in VLLM_ROLES:
            data["kv_role"] = VLLM_ROLES[data["kv_role"]]
        return cls.load(**data)

    @classmethod
    def load(
        cls, path: str | Path | None = None, env_prefix: str = "KV_TRANSFER_", **overrides: Any
    ) -> KVTransferConfig:
        """Defaults < YAML file < KV_TRANSFER_* environment < explicit overrides (None is ignored)."""
        return cls(**load_layers(cls, path, env_prefix, overrides))


def read_token_file(path: str | Path) -> str:
    """The bearer token in `path` (surrounding whitespace stripped); a missing or empty file is a ConfigError."""
    try:
        token = Path(path).expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the token file {path}: {e}") from None
    if not token:
        raise ConfigError(f"the token file {path} is empty")
    return token
