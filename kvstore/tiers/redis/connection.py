"""How the redis tier connects: its URLs, and connections that send values without a copy.

- `split_url` turns `redis://[user:password@]h1:p1[,h2:p2...]/db` (or `rediss://...`) into redis-py
  options and the list of hosts; anything malformed is a ConfigError.
- Connections send values as they are (redis-py's hiredis packer copies each one into a new buffer).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.connection import Encoder, PythonRespSerializer, parse_url

from kvstore.errors import ConfigError

CONNECT_TIMEOUT_S = 0.5
SOCKET_TIMEOUT_S = 2.0
PACK_CUTOFF = 6000  # values longer than this are sent as they are (redis-py's own cutoff)


def _zero_copy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Connection options that send values as they are: redis-py's hiredis packer copies every value
    into one new buffer, its Python packer passes large values through. `command_packer` is a
    constructor argument of redis-py connections (not a documented one: the canary in
    tests/kvstore/test_redis_canary.py fails when it stops passing values through; pyproject pins
    redis below the next major version)."""
    encoder = Encoder(kwargs.get("encoding", "utf-8"), kwargs.get("encoding_errors", "strict"), False)
    return {"command_packer": PythonRespSerializer(PACK_CUTOFF, encoder.encode), **kwargs}


class ZeroCopyConnection(redis.Connection):
    """A connection that sends values without copying them (a class, because a Cluster client takes
    a `connection_class` but drops a `command_packer` option)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**_zero_copy(kwargs))


class ZeroCopySSLConnection(redis.SSLConnection):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**_zero_copy(kwargs))


def split_url(url: str) -> tuple[str, dict[str, Any], list[tuple[str, int]]]:
    """The URL cut to its first host, redis-py connection options from it, and every host:port listed."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"redis_url must start with redis:// or rediss://, got {url!r}")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts: list[tuple[str, int]] = []
    for item in filter(None, hostlist.split(",")):
        host, _, port = item.rpartition(":") if item.rpartition(":")[2].isdigit() else (item, "", "6379")
        hosts.append((host.strip("[]") or "127.0.0.1", int(port)))
    if not hosts:
        raise ConfigError(f"redis_url names no host: {url!r}")
    if not (parts.path.strip("/") or "0").isdigit():
        raise ConfigError(f"redis_url path must be a db number, got {parts.path!r} in {url!r}")
    first = f"{userinfo}@{hosts[0][0]}:{hosts[0][1]}" if userinfo else f"{hosts[0][0]}:{hosts[0][1]}"
    first_url = urlunsplit(parts._replace(netloc=first))
    try:
        options = parse_url(first_url)
    except ValueError as e:
        raise ConfigError(f"bad redis_url {url!r}: {e}") from None
    return first_url, options, hosts
