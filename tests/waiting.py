"""Waiting on a condition, never on a duration: poll until it holds, fail after a deadline.

A test that waits for another process (a server, Valkey, a subscriber) to do something polls what
that something changes; a time-based behaviour of our own code is stepped with a
`kvstore.clock.ManualClock` instead (tests/project/test_sleeps.py holds every sleep left in tests/
to an allow-list)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object],
    timeout: float = 15.0,
    interval: float = 0.05,
    error: type[Exception] = AssertionError,
    what: str = "condition",
) -> None:
    """Poll until `condition()` is truthy; raise `error` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise error(f"{what} not met within {timeout}s")
        time.sleep(interval)


async def wait_until_async(
    condition: Callable[[], object], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> None:
    """`wait_until` for a test running in an event loop (the loop runs meanwhile); `condition` may be a
    coroutine function (a request to an app under test)."""
    deadline = time.monotonic() + timeout
    while True:
        ok = condition()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, f"{what} not met within {timeout}s"
        await asyncio.sleep(interval)
