"""One circuit breaker, shared by the redis tier (one per server, kvstore/tiers/redis/servers.py) and
the connectors' store handle (connectors/store_handle.py).

Closed while calls succeed. After a failure it is open for a backoff: callers fail fast without
touching the network. When the backoff has passed it is half open: one caller probes (`allow`
claims the probe; the others keep failing fast for another backoff) or, for callers that do not need
one probe (`refusing`), anyone may try. A success closes it (the backoff back to its minimum); a
failure while open doubles the backoff, up to its maximum. `failure` and `success` say when an outage
starts and ends, so each is logged once. Its time is its `clock`'s (kvstore/clock.py: the store's, so a
test steps a backoff instead of sleeping through it), or the `now` a caller passes. Thread-safe enough for its use: the fields are written under
the GIL, and a lost race lets at most one extra probe through.
"""

from __future__ import annotations

from kvstore.clock import SYSTEM, Clock
from kvstore.errors import ConfigError


class Breaker:
    """A circuit breaker whose backoff doubles from `min_s` to `max_s` (equal: a fixed backoff; 0: none)."""

    def __init__(self, min_s: float = 0.1, max_s: float = 5.0, clock: Clock = SYSTEM) -> None:
        if not 0 <= min_s <= max_s:
            raise ConfigError(f"breaker backoff must satisfy 0 <= min_s <= max_s, got {min_s}, {max_s}")
        self.min_s, self.max_s = min_s, max_s
        self.clock = clock
        self.down = False
        self.delay = min_s
        self.until = 0.0

    def refusing(self, now: float | None = None) -> bool:
        """True while open and within its backoff (fail fast); claims nothing."""
        return self.down and (self.clock.monotonic() if now is None else now) < self.until

    def allow(self, now: float | None = None) -> bool:
        """Whether this caller may call: closed, or the one probe once the backoff has passed."""
        if not self.down:
            return True
        now = self.clock.monotonic() if now is None else now
        if now < self.until:
            return False
        self.until = now + self.delay  # this caller probes; the others keep failing fast meanwhile
        return True

    def failure(self, now: float | None = None) -> bool:
        """Open (again); returns True when this failure starts an outage."""
        now = self.clock.monotonic() if now is None else now
        started = not self.down
        self.delay = self.min_s if started else min(self.delay * 2, self.max_s)
        self.down, self.until = True, now + self.delay
        return started

    def success(self) -> bool:
        """Close; returns True when this success ends an outage."""
        ended, self.down, self.delay = self.down, False, self.min_s
        return ended
