"""A hung, wrong or refusing server costs an SDK call a bounded time and a typed error.

Hung: a listening socket that accepts and never answers, and a real kvstore-server stopped with
SIGSTOP. With the defaults a call fails after `timeout` (10 s), not a timeout per retry; a timeout is
retried only when asked (`retry_timeouts=True`). `Store.health()` answers in the same bound whatever
the server does; `Store.connect(..., check=True)` fails a wrong URL or token at once.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvstore.sdk import Store
from kvstore.sdk.remote import RemoteBackend

import kvstore
from kvstore.errors import Unauthorized, Unavailable
from tests.connectors.conftest import ServerProcess
from tests.server.conftest import key, make_blob
from tests.valkey import free_port

DEFAULT_TIMEOUT = 10.0  # RemoteBackend's default, as the README documents it
SLACK = 2.5  # thread start, a connection refused and retried, a loaded box


@pytest.fixture
def hung_url() -> Iterator[str]:
    """A TCP port whose listener never accepts: the kernel completes the handshake, nothing answers."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def timed(fn: Callable[[], Any], bound: float) -> tuple[float, BaseException | None, Any]:
    """(seconds, what it raised, what it returned) of `fn()` in a thread, failing the test when it
    takes longer than `bound` (the thread is left behind then: a hung call cannot be cut short)."""
    box: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test below
            box["error"] = e
        box["took"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"the call still waits after {bound:.1f} s"
    return box["took"], box.get("error"), box.get("value")


@pytest.mark.parametrize("transport", ["auto", "http"])
def test_with_the_defaults_a_hung_server_fails_a_call_after_the_timeout(hung_url, transport) -> None:
    store = Store.connect(hung_url, transport=transport)
    try:
        took, err, _ = timed(lambda: store.exists(key(1)), DEFAULT_TIMEOUT + SLACK)
    finally:
        store.close()
    assert isinstance(err, Unavailable) and "no answer within 10 s" in str(err), err
    assert DEFAULT_TIMEOUT - 0.5 < took, took  # the timeout, once: no retry of it


def test_a_timeout_is_retried_only_when_asked(hung_url) -> None:
    be = RemoteBackend(hung_url, timeout=0.5, retries=2, transport="http", retry_timeouts=True)
    took, err, _ = timed(lambda: be.exists(key(1)), 3 * 0.5 + SLACK)
    assert isinstance(err, Unavailable) and took >= 3 * 0.5 - 0.1, took
    be.close()
    be = RemoteBackend(hung_url, timeout=0.5, retries=2, transport="http")
    took, err, _ = timed(lambda: be.exists(key(1)), 0.5 + SLACK)
    assert isinstance(err, Unavailable) and took < 1.0, took
    be.close()


def test_health_of_a_hung_server_answers_within_the_timeout(hung_url) -> None:
    with Store.connect(hung_url, timeout=1) as store:
        took, err, health = timed(store.health, 1 + SLACK)
    assert err is None
    assert (health.reachable, health.authorized, health.ok) == (False, False, False)
    assert "no answer within 1 s" in health.error and health.latency_s < 1 + SLACK


@pytest.fixture
def stoppable() -> Iterator[ServerProcess]:
    server = ServerProcess("--tiers", "cpu", "--cpu-capacity", "64MiB").start()
    try:
        yield server
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.parametrize("transport", ["shm", "tcp", "http"])
def test_a_sigstopped_kvstore_server_fails_calls_within_the_timeout(stoppable, transport) -> None:
    store = Store.connect(stoppable.url, timeout=1.5, transport=transport)
    try:
        store.put(key(1), make_blob(1))
        assert store.health().ok
        os.kill(stoppable.proc.pid, signal.SIGSTOP)
        for call in (lambda: store.exists(key(2)), lambda: store.put(key(3), make_blob(3))):
            took, err, _ = timed(call, 1.5 + SLACK)
            assert isinstance(err, Unavailable), err
        took, err, health = timed(store.health, 1.5 + SLACK)
        assert err is None and not health.reachable, health
        os.kill(stoppable.proc.pid, signal.SIGCONT)
        assert store.exists(key(1)) and store.health().ok  # the same client works again
    finally:
        store.close()


def test_check_fails_a_wrong_url_or_token_at_connect(server_factory) -> None:
    srv = server_factory(auth_token="t0ken")
    with Store.connect(srv.url, token="t0ken", check=True) as store:
        health = store.health()
    assert health.ok and health.error is None and health.version == kvstore.__version__
    assert health.tiers == ("cpu",) and health.transport == "shm" and health.url == srv.url
    with pytest.raises(Unauthorized):
        Store.connect(srv.url, token="wrong", check=True)
    with pytest.raises(Unauthorized):
        Store.connect(srv.url, check=True)
    with Store.connect(srv.url, token="wrong") as store:  # no check: the answer says it, no raise
        health = store.health()
    assert health.reachable and not health.authorized and "Unauthorized" in health.error
    t0 = time.monotonic()
    with pytest.raises(Unavailable):
        Store.connect(f"http://127.0.0.1:{free_port()}", check=True)  # nobody listens
    assert time.monotonic() - t0 < SLACK


def test_check_names_an_http_server_that_is_not_a_kvstore_server() -> None:
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{other.server_address[1]}"
        with pytest.raises(Unavailable, match="not a kvstore-server"):
            Store.connect(url, check=True)
    finally:
        other.shutdown()
        other.server_close()


def test_an_in_process_store_is_healthy(tmp_path) -> None:
    with Store.local(tiers=["cpu", "disk"], disk_path=tmp_path / "d") as store:
        health = store.health()
    assert health.ok and health.tiers == ("cpu", "disk") and health.transport == "local"
    assert health.version == kvstore.__version__
