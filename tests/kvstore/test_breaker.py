"""The circuit breaker the redis tier and the connectors' store handle share (kvstore/breaker.py)."""

from __future__ import annotations

import pytest

from kvstore.breaker import Breaker
from kvstore.clock import ManualClock
from kvstore.errors import ConfigError


def test_one_probe_after_a_doubling_backoff() -> None:
    b = Breaker(0.1, 0.4)
    assert b.allow(0.0) and not b.down
    assert b.failure(0.0)  # an outage starts
    assert not b.allow(0.05) and b.refusing(0.05)  # failing fast, nothing touched
    assert b.allow(0.1)  # the backoff has passed: this caller probes...
    assert not b.allow(0.11)  # ...and the others keep failing fast meanwhile
    assert not b.failure(0.12)  # the probe failed: the same outage, the backoff doubled
    assert b.delay == pytest.approx(0.2) and not b.allow(0.3) and b.allow(0.33)
    b.failure(0.33)
    b.allow(0.73)
    b.failure(0.73)
    assert b.delay == pytest.approx(0.4)  # capped at max_s
    assert b.success() and not b.down and b.delay == pytest.approx(0.1)  # the outage ends, once
    assert not b.success() and b.allow(0.74)


def test_refusing_lets_anyone_try_after_a_fixed_backoff() -> None:
    b = Breaker(5.0, 5.0)  # the store handle's: unreachable_backoff_s, fixed
    assert not b.refusing(0.0)
    assert b.failure(0.0) and b.refusing(4.9)
    assert not b.refusing(5.0) and not b.refusing(5.0)  # no probe claimed: every caller may try
    assert not b.failure(5.1) and b.delay == 5.0 and b.refusing(10.0) and not b.refusing(10.1)


def test_bad_backoffs_are_refused() -> None:
    for lo, hi in ((2.0, 1.0), (-1.0, 1.0)):
        with pytest.raises(ConfigError):
            Breaker(lo, hi)


def test_its_time_is_its_clocks() -> None:
    """The store's clock (kvstore/clock.py): a test steps a backoff instead of sleeping through it."""
    clock = ManualClock()
    b = Breaker(0.1, 5.0, clock)
    assert b.failure() and not b.allow() and b.refusing()
    clock.advance(0.1)
    assert b.allow() and not b.allow()  # the one probe
    assert not b.failure() and b.delay == pytest.approx(0.2)
    clock.advance(0.19)
    assert b.refusing()
    clock.advance(0.02)
    assert not b.refusing() and b.allow() and b.success()
