"""After answering a client on this host, the event loop polls its sockets for a moment before it
sleeps.

A thread asleep in epoll is woken by an interrupt to its CPU; on a virtual machine that costs tens of
microseconds, paid by the client inside its `send`, on every request of a ping-pong (the client's
half is kvstore.sdk.dataplane's poll-before-sleep). So after a reply to a same-host connection the loop
checks, for up to `poll_s`, whether any same-host connection has a request waiting (yielding the CPU
between checks, so a client waiting for this CPU runs), and returns to asyncio as soon as one has.
Other connections wait at most `poll_s` longer for the loop meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import select
import time


class IdlePoll:
    def __init__(self, poll_s: float) -> None:
        assert 0 <= poll_s < 1, poll_s
        self.poll_s = poll_s
        self._epoll = select.epoll() if poll_s else None
        self._scheduled = False

    def add(self, fd: int) -> bool:
        """Watch a same-host connection's socket until it closes (epoll drops a closed socket by
        itself; unregistering by number could hit a newer socket that got the same number); False
        when polling is off."""
        if self._epoll is None:
            return False
        try:
            self._epoll.register(fd, select.EPOLLIN)
        except FileExistsError:  # the same socket again
            self._epoll.modify(fd, select.EPOLLIN)
        return True

    def after_reply(self) -> None:
        """Poll once the loop has run what is ready now (one poll per loop iteration at most)."""
        if self._epoll is not None and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._poll)

    def _poll(self) -> None:
        self._scheduled = False
        assert self._epoll is not None
        deadline = time.perf_counter() + self.poll_s
        while not self._epoll.poll(0):
            if time.perf_counter() >= deadline:
                return
            os.sched_yield()

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
