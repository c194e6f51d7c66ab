"""`StoreHealth`: what `Store.health()` answers about the store behind a client."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.errors import KVStoreError, Unavailable


@dataclass(frozen=True)
class StoreHealth:
    """`reachable`: the store answered (for a server: its `/healthz`, within the client's timeout).
    `authorized`: it accepted this client (its token) and answered an authenticated call; a store
    that is reachable and authorized is usable. `error` says what failed, else None."""

    url: str  # the server's URL, or "local" for an in-process store
    reachable: bool
    authorized: bool
    latency_s: float  # how long the answer took
    error: str | None = None
    version: str | None = None  # kvstore's version on the store's side (None: a server too old to say)
    tiers: tuple[str, ...] = ()  # its tiers, top down
    transport: str | None = None  # how calls travel: "shm", "tcp", "http", or "local"

    @property
    def ok(self) -> bool:
        return self.reachable and self.authorized


def probe(
    url: str, healthz: Callable[[], Any], stats: Callable[[], dict], transport: Callable[[], str]
) -> tuple[StoreHealth, KVStoreError | None]:
    """What a server answers (`healthz()`: its open /healthz), whether it accepts this client
    (`stats()`: an authenticated /v1/stats) and what it runs; and the error a call would raise. Never
    raises over a server that is down, hung, not a kvstore-server or refusing the token."""
    started = time.monotonic()

    def answer(
        reachable: bool, err: KVStoreError | None, **more: Any
    ) -> tuple[StoreHealth, KVStoreError | None]:
        error = None if err is None else f"{type(err).__name__}: {err}"
        return StoreHealth(url, reachable, err is None, time.monotonic() - started, error, **more), err

    try:
        alive = healthz()
    except Unavailable as e:
        return answer(False, e)
    except (KVStoreError, ValueError) as e:  # an HTTP server, but not ours (a 404, HTML...)
        return answer(False, Unavailable(f"{url} is not a kvstore-server (/healthz: {e})"))
    if not isinstance(alive, dict) or alive.get("status") != "ok":
        return answer(False, Unavailable(f"{url} is not a kvstore-server (/healthz: {alive!r:.80})"))
    try:
        got = stats()  # authenticated: proves the token
        how = transport()
    except KVStoreError as e:
        return answer(True, e)
    tiers = tuple(str(t.get("name")) for t in got.get("tiers", ()))
    version = (got.get("server") or {}).get("version")
    return answer(True, None, version=version, tiers=tiers, transport=how)
