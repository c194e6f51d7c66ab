"""Store configuration: `StoreConfig`, layered by `kvstore.settings` (defaults < YAML < KVSTORE_* env <
arguments). Sizes accept pydantic `ByteSize` strings ('8GiB', '500MB')."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvstore.errors import ConfigError
from kvstore.settings import Size, human_error, load_settings, parse_size, read_yaml_mapping

__all__ = ["CpuMemory", "StoreConfig", "TierName", "default_data_dir", "parse_size", "read_yaml_mapping"]

TierName = Literal["gpu", "cpu", "disk", "redis"]
# where the cpu tier keeps its blobs (kvstore.tiers.cpu): auto, plain, pinned (needs CUDA), arena
CpuMemory = Literal["auto", "plain", "pinned", "arena"]


def default_data_dir() -> Path:
    return Path(os.environ.get("KVSTORE_DATA_DIR", Path.home() / ".cache" / "kvstore" / "data"))


class StoreConfig(BaseModel):
    """How a tiered store is built. Sizes accept '8GiB'-style strings."""

    model_config = ConfigDict(extra="forbid")

    tiers: list[TierName] = Field(default_factory=lambda: ["cpu", "disk"])
    gpu_capacity: Size = 4 * 2**30
    cpu_capacity: Size = 4 * 2**30
    # where the cpu tier's blobs live (kvstore.tiers.cpu): "arena" (shared memory same-host clients map
    # read-only; what "auto" is in a kvstore-server with shared memory), "pinned" (page-locked, for a
    # GPU in this process; needs CUDA), "plain"; "auto" elsewhere: pinned with CUDA, else plain
    cpu_memory: CpuMemory = "auto"
    disk_capacity: Size = 64 * 2**30
    disk_path: Path = Field(default_factory=lambda: default_data_dir() / "disk")
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "kvstore:"
    redis_cluster: bool = False
    redis_max_invalidated: int = Field(100_000, ge=1)  # deletes/replaces an outage may leave to replay
    # a put is stored in redis once this many replicas have it (WAIT); 0: once the primary has it
    redis_wait_replicas: int = Field(0, ge=0)
    # what must survive a restart besides the blobs: the redis tier's pending invalidations
    state_dir: Path = Field(default_factory=lambda: default_data_dir() / "state")
    write_policy: Literal["through", "back"] = "through"
    write_back_queue: int = 256  # blobs waiting for lower tiers before puts start to drop
    admission_hits: int = 0  # a blob reaches lower tiers only after this many hits (0: always)
    ttl: float | None = None  # seconds; None keeps blobs until evicted
    codec: str = "raw"  # default codec when a tensor (not a blob) is put
    # a codec per tier, "cpu=raw,disk=kivi4,redis=kivi4+ans": a blob is re-encoded once where it
    # enters such a tier (kvstore.codecs.transcode); tiers not named keep blobs as they come
    tier_codec: dict[str, str] = Field(default_factory=dict)
    lz4: bool = False
    max_blob_size: Size = 256 * 2**20
    miss_log_keys: int = Field(1 << 16, ge=0)  # recently written keys remembered to explain misses

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise human_error(e, "store settings") from None

    @field_validator("tiers", mode="before")
    @classmethod
    def _tiers(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [t.strip() for t in v.split(",") if t.strip()]
        if not v or len(set(v)) != len(v):
            raise ConfigError(f"tiers must be a non-empty list without repeats, got {v!r}")
        return v

    @field_validator("tier_codec", mode="before")
    @classmethod
    def _tier_codec(cls, v: Any) -> Any:
        if isinstance(v, str):
            pairs = [p.partition("=") for p in v.split(",") if p.strip()]
            if any(not sep or not t.strip() or not c.strip() for t, sep, c in pairs):
                raise ConfigError(f"tier_codec is tier=codec[,tier=codec...], got {v!r}")
            return {t.strip(): c.strip() for t, _, c in pairs}
        return v

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        env_prefix: str = "KVSTORE_",
        defaults: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> StoreConfig:
        """Defaults < YAML file < KVSTORE_* environment < explicit overrides (see kvstore.settings)."""
        (config,) = load_settings(
            [cls], path, overrides, env_prefix=env_prefix, use_config_env=False, defaults=defaults
        )
        return config
