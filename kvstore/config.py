"""Store configuration: pydantic models, readable from YAML and KVSTORE_* environment variables."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvstore.errors import ConfigError

TierName = Literal["gpu", "cpu", "disk", "redis"]
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mi": 2**20, "mib": 2**20, "g": 10**9, "gb": 10**9, "gi": 2**30, "gib": 2**30,
          "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40}  # fmt: skip


def parse_size(value: int | str) -> int:
    """'8GiB' -> 8589934592; plain ints pass through."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (examples: 512MiB, 8GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_data_dir() -> Path:
    return Path(os.environ.get("KVSTORE_DATA_DIR", Path.home() / ".cache" / "kvstore" / "data"))


class StoreConfig(BaseModel):
    """How a tiered store is built. Sizes accept '8GiB'-style strings."""

    model_config = ConfigDict(extra="forbid")

    tiers: list[TierName] = Field(default_factory=lambda: ["cpu", "disk"])
    gpu_capacity: int = 4 * 2**30
    cpu_capacity: int = 4 * 2**30
    disk_capacity: int = 64 * 2**30
    disk_path: Path = Field(default_factory=lambda: default_data_dir() / "disk")
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "kvstore:"
    redis_cluster: bool = False
    write_policy: Literal["through", "back"] = "through"
    write_back_queue: int = 256  # blobs waiting for lower tiers before puts start to drop
    admission_hits: int = 0  # a blob reaches lower tiers only after this many hits (0: always)
    ttl: float | None = None  # seconds; None keeps blobs until evicted
    codec: str = "raw"  # default codec when a tensor (not a blob) is put
    lz4: bool = False
    max_blob_size: int = 256 * 2**20

    @field_validator("gpu_capacity", "cpu_capacity", "disk_capacity", "max_blob_size", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("tiers", mode="before")
    @classmethod
    def _tiers(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [t.strip() for t in v.split(",") if t.strip()]
        if not v or len(set(v)) != len(v):
            raise ConfigError(f"tiers must be a non-empty list without repeats, got {v!r}")
        return v

    @classmethod
    def load(
        cls, path: str | Path | None = None, env_prefix: str = "KVSTORE_", **overrides: Any
    ) -> StoreConfig:
        """Defaults < YAML file < KVSTORE_* environment < explicit overrides."""
        try:
            return cls(**load_layers(cls, path, env_prefix, overrides))
        except ValidationError as e:
            raise ConfigError(f"invalid {cls.__name__}: {e}") from None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML config file that must hold a mapping; ConfigError otherwise."""
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must be a mapping")
    return loaded


def load_layers(model: type[BaseModel], path: str | Path | None, env_prefix: str, overrides: dict) -> dict:
    data: dict[str, Any] = read_yaml_mapping(path) if path is not None else {}
    for name in model.model_fields:
        env = os.environ.get(env_prefix + name.upper())
        if env is not None:
            data[name] = yaml.safe_load(env) if name != "tiers" else env
    data.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(data) - set(model.model_fields)
    if unknown:
        raise ConfigError(f"unknown config keys: {sorted(unknown)}")
    return data
