"""The request-body budget: bytes of request bodies received or being stored at once, over every
connection, so that the server's memory stays within idle + tier capacity + the budget.

A body reserves what reading it holds at its peak before a byte of it is read: its declared
Content-Length for one blob (read in place, server/body.py), the frame's payloads for a batch, twice
the length of a JSON body (its chunks, then the bytes they are joined into); chunked bodies: as the
chunks come. Beyond the budget the request
is a 503 with Retry-After, its body never read (aiohttp drains it into nothing). A request that
needs more than the whole budget could never fit: 413. Large bodies (over an
eighth of the budget) share at most three quarters of it, so a flood of big uploads leaves room for
everyone else's small ones. The reservation is returned when the response is done: by then the bytes
are a tier's (counted in its capacity) or garbage.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvstore.errors import Busy, TooLarge

_RequestKey = getattr(web, "RequestKey", None)
RESERVED: Any = _RequestKey("body_reserved", list) if _RequestKey else "kvstore_body_reserved"


class BodyBudget:
    """Counts reserved body bytes. Event-loop only (not thread-safe, and needs not be)."""

    def __init__(self, limit: int) -> None:
        assert limit > 0, limit
        self.limit = limit
        self.used = 0
        self.used_large = 0
        self._large = max(1, limit // 8)

    def reserve(self, request: web.BaseRequest, n: int) -> None:
        """Take `n` bytes for `request` (returned by `release`), or raise Busy / TooLarge."""
        if n > self.limit:
            raise TooLarge(f"this body needs {n} bytes, over the server's {self.limit}-byte in-flight budget")
        large = n > self._large
        if self.used + n > self.limit or (large and self.used_large + n > self.limit * 3 // 4):
            raise Busy(
                f"{self.used} of {self.limit} request body bytes are in flight; this one ({n}) must wait: "
                "retry after a moment"
            )
        held = request.get(RESERVED) or [0, 0]  # [bytes, of which large]
        held[0] += n
        self.used += n
        if large:
            held[1] += n
            self.used_large += n
        request[RESERVED] = held

    def release(self, request: web.BaseRequest) -> None:
        held = request.get(RESERVED)
        if held:
            request[RESERVED] = None
            self.used -= held[0]
            self.used_large -= held[1]
            assert self.used >= 0 and self.used_large >= 0, (self.used, self.used_large)
