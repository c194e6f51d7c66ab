"""The commands the redis tier sends, and the values it sends: pipelines (with ASKING and WAIT), one
command after ASKING, blobs as redis-py sends them without a copy, TTLs in ms, the server's INFO."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import redis

from kvstore.lru import check_ttl
from kvstore.protocol import Blob
from kvstore.tiers.base import TierStats


def asking(client: redis.Redis, fn: Callable[[redis.Redis], Any]) -> Any:
    """fn (one command) right after ASKING on the same connection (ASKING lasts one command)."""
    with redis.Redis(connection_pool=client.connection_pool, single_connection_client=True) as one:
        one.execute_command("ASKING")
        return fn(one)


def replicated(replies: list[Any], wait: tuple[int, int]) -> list[Any]:
    """The replies of a pipeline that ended with WAIT, without it; every write turned into an error
    when fewer than `wait[0]` replicas acknowledged them within `wait[1]` ms."""
    *replies, acked = replies
    if not isinstance(acked, Exception) and acked >= wait[0]:
        return replies
    short = redis.ResponseError(f"WAIT {wait[0]}: {acked} replicas acknowledged within {wait[1]} ms")
    return [r if isinstance(r, Exception) else short for r in replies]


def pipelined(client: redis.Redis, cmds: Sequence[tuple[Any, ...]]) -> list[Any]:
    """One round trip; per-command errors come back as exception objects. ("asking",) sends ASKING,
    ("wait", replicas, ms) WAIT."""
    pipe = client.pipeline(transaction=False)
    for cmd in cmds:
        if cmd[0] == "asking":
            pipe.execute_command("ASKING")
        elif cmd[0] == "wait":
            pipe.execute_command("WAIT", cmd[1], cmd[2])
        elif cmd[0] == "get":
            pipe.get(cmd[1])
        elif cmd[0] == "exists":
            pipe.exists(cmd[1])
        elif cmd[0] == "delete":
            pipe.delete(cmd[1])
        else:
            pipe.set(cmd[1], cmd[2], px=cmd[3])
    return pipe.execute(raise_on_error=False)


def as_value(blob: Blob) -> tuple[bytes | memoryview, int]:
    """The blob as redis-py sends it without a copy, and its size in bytes."""
    if isinstance(blob, bytes):
        return blob, len(blob)
    mv = memoryview(blob)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    return mv, mv.nbytes


def px_of(ttl_s: float | None) -> int | None:
    if check_ttl(ttl_s) is None:
        return None
    return max(1, math.ceil(ttl_s * 1000))


def server_info(
    client: redis.Redis, stats: TierStats, maxmemory: int | None, warn: Callable[..., None]
) -> int:
    """CONFIG SET `maxmemory` (+ allkeys-lru) if given; records the server's counters in `stats.extra`;
    warns about settings that make a poor cache; returns the server's maxmemory."""
    if maxmemory is not None:
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.config_set("maxmemory", maxmemory)
    info = {**client.info("memory"), **client.info("stats")}
    for field in ("used_memory", "maxmemory", "evicted_keys", "expired_keys"):
        stats.extra[f"server_{field}"] = float(info.get(field, 0))
    policy = str(info.get("maxmemory_policy", ""))
    if not int(info.get("maxmemory", 0)):
        warn(
            "maxmemory", "redis has no maxmemory: it grows until it is killed; set maxmemory and allkeys-lru"
        )
    elif not policy.startswith("allkeys-"):
        warn("policy", "redis maxmemory-policy is %s: puts fail when full; use allkeys-lru", policy)
    return int(info.get("maxmemory", 0))
