"""The settings blocks of the built-in tiers (kvstore/tier_registry.py declares them): in YAML
`redis: {url: ..., prefix: ...}`, flat `redis_url`, `--redis-url`, `KVSTORE_REDIS_URL` (kvstore.config)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvstore.settings import Size, default_data_dir

# where the cpu tier keeps its blobs (kvstore.tiers.cpu): auto, plain, pinned (needs CUDA), arena
CpuMemory = Literal["auto", "plain", "pinned", "arena"]


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuSettings(_Block):
    capacity: Size = 4 * 2**30


class CpuSettings(_Block):
    capacity: Size = 4 * 2**30
    # "arena" (shared memory same-host clients map read-only; what "auto" is in a kvstore-server with
    # shared memory), "pinned" (page-locked, for a GPU in this process; needs CUDA), "plain"; "auto"
    # elsewhere: pinned with CUDA, else plain
    memory: CpuMemory = "auto"


class DiskSettings(_Block):
    capacity: Size = 64 * 2**30
    path: Path = Field(default_factory=lambda: default_data_dir() / "disk")


class RedisSettings(_Block):
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "kvstore:"
    cluster: bool = False
    max_invalidated: int = Field(100_000, ge=1)  # deletes/replaces an outage may leave to replay
    # a put is stored in redis once this many replicas have it (WAIT); 0: once the primary has it
    wait_replicas: int = Field(0, ge=0)


class FsSettings(_Block):
    path: Path | None = None  # the directory the servers share (required)
    capacity: Size = 64 * 2**30
    max_age: float | None = Field(None, gt=0)  # seconds a blob may go unused before a sweep removes it
    sweep_interval: float = Field(30.0, gt=0)  # seconds between this server's sweeps of the directory
    fsync: bool = True  # a put is acknowledged once its file and rename are on disk
    max_invalidated: int = Field(100_000, ge=1)  # deletes/replaces an outage may leave to replay
