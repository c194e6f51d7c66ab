"""The connector's startup check of a kvstore-server says what really happened, and shows no token."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.store_handle import StoreHandle, acquire_store, release_store

from kvstore.clock import ManualClock
from kvstore.errors import ConfigError, Unavailable
from tests.connectors.conftest import ServerProcess

TOKEN = "s3cret-token-0123456789abcdef"


@pytest.fixture
def other_web_server(tmp_path: Path) -> Iterator[str]:
    """A real HTTP server that is not a kvstore-server (a wrong URL): 404 to every path."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_config_and_its_store_handle_never_show_the_token() -> None:
    config = KVTransferConfig(store_url="http://127.0.0.1:1", auth_token=TOKEN)
    assert TOKEN not in repr(config) and TOKEN not in str(config)
    assert config.token() == TOKEN  # still there for the client
    server = ServerProcess("--tiers", "cpu", "--auth-token", TOKEN).start()
    try:
        handle = acquire_store(KVTransferConfig(store_url=server.url, auth_token=TOKEN))
        try:
            assert TOKEN not in repr(handle.key)
        finally:
            release_store(handle)
    finally:
        server.stop()


def test_a_server_refusing_everyone_stops_the_engine_not_called_unreachable(caplog) -> None:
    """Host `127.1` (loopback, but not an IP address Python parses) without a token: the server's
    DNS-rebinding check answers 403 to every request."""
    server = ServerProcess("--tiers", "cpu").start()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match=r"refused access \(403\)"):
            release_store(acquire_store(KVTransferConfig(store_url=f"http://127.1:{server.port}")))
    finally:
        server.stop()
    assert "does not answer" not in caplog.text


def test_a_4xx_answer_is_not_called_unreachable(caplog, other_web_server: str) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.connectors.store_handle"):
        release_store(acquire_store(KVTransferConfig(store_url=other_web_server)))
    assert "does not answer" not in caplog.text
    assert "HTTP 404" in caplog.text and "is the URL a kvstore-server?" in caplog.text


def test_a_closed_port_is_unreachable(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.connectors.store_handle"):
        release_store(acquire_store(KVTransferConfig(store_url="http://127.0.0.1:1", timeout_s=2)))
    assert "does not answer yet" in caplog.text


def test_a_failed_store_is_skipped_for_the_backoff_then_anyone_may_try(caplog) -> None:
    """The handle's circuit breaker (kvstore/breaker.py): a fixed backoff, logged once per backoff."""
    clock = ManualClock()
    handle = StoreHandle(("test",), store=None, backoff_s=0.2, clock=clock)
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.connectors.store_handle"):
            assert handle.reachable()
            handle.mark_unreachable(Unavailable("down"))
            assert not handle.reachable()
            handle.mark_unreachable(Unavailable("still down"))  # within the backoff: no second line
            clock.advance(0.25)  # past the backoff
            assert handle.reachable() and handle.reachable()  # no probe claimed: every caller may try
            handle.mark_unreachable(Unavailable("down again"))  # after the backoff: said again
            assert not handle.reachable()
    finally:
        handle._lookup_pool.shutdown()
    assert caplog.text.count("KV store unreachable") == 2
