"""`StoreHealth`: what `Store.health()` answers about the store behind a client."""

from __future__ import annotations

from dataclasses import dataclass


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
