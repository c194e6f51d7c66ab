"""What the SDK's two transport clients share (sdk.http.HttpClient, sdk.dataplane.DataPlaneClient):
their timeouts, pool size and retry policy, and the one loop that retries an exchange.

A failed exchange is tried again after a connection error or a 502/503/504 (every kvstore call is
idempotent: a blob's key names its content), up to `retries` times with exponential backoff, while
the call is younger than `timeout`; after a timeout (no answer within `timeout`) only with
`retry_timeouts`, and then a hung server holds a call `retries + 1` times `timeout`. By default a
server that accepts and does not answer costs one call `timeout` seconds, not a multiple.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvstore.errors import Unavailable

RETRY_STATUSES = frozenset({502, 503, 504})
T = TypeVar("T")


def failure(what: str, err: BaseException, timeout: float) -> Unavailable:
    """The Unavailable a failed exchange raises: a timeout says how long it waited."""
    if isinstance(err, TimeoutError):
        return Unavailable(f"{what}: no answer within {timeout:g} s (the client's timeout)")
    return Unavailable(f"{what} failed: {err}")


@dataclass(frozen=True)
class ClientOptions:
    """A transport client's settings: `timeout` the longest a call waits for an answer (also each
    socket operation's), `connect_timeout` for a connection, `pool_size` keep-alive connections, and
    the retry policy (`retries`, `backoff` doubling per attempt, `retry_timeouts`)."""

    timeout: float
    connect_timeout: float
    retries: int
    backoff: float
    pool_size: int
    retry_timeouts: bool = False

    def delay(
        self, attempt: int, started: float, timed_out: bool = False, at_least: float = 0.0
    ) -> float | None:
        """Seconds to sleep before attempt `attempt + 1` of a call begun at `started` (monotonic), or
        None: give up now."""
        if attempt >= self.retries or (timed_out and not self.retry_timeouts):
            return None
        wait = max(self.backoff * 2**attempt, at_least)
        if not timed_out and time.monotonic() - started + wait > self.timeout:
            return None
        return wait

    def with_retries(self, what: str, once: Callable[[], T], busy: Callable[[T], float | None]) -> T:
        """`once()` (one exchange) until it answers, retried as the policy says. A connection error
        (OSError, ConnectionError) past the policy raises `failure(what, ...)`. `busy(answer)`: None
        for an answer to return, else the least seconds to wait before asking again (a 502/503/504;
        returned as it is once the policy gives up)."""
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                answer = once()
            except (OSError, ConnectionError) as e:
                wait = self.delay(attempt, started, timed_out=isinstance(e, TimeoutError))
                if wait is None:
                    raise failure(what, e, self.timeout) from None
            else:
                at_least = busy(answer)
                if at_least is None or (wait := self.delay(attempt, started, at_least=at_least)) is None:
                    return answer
            time.sleep(wait)
            attempt += 1
