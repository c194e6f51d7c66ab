"""The retry policy both SDK transport clients share (sdk/options.py: ClientOptions)."""

from __future__ import annotations

import time

import pytest
from kvstore.sdk import options as options_module
from kvstore.sdk.options import ClientOptions

from kvstore.errors import Unavailable


def opts(**kw: float) -> ClientOptions:
    return ClientOptions(
        **{"timeout": 10.0, "connect_timeout": 1.0, "retries": 3, "backoff": 0.05, "pool_size": 1, **kw}
    )


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waits: list[float] = []
    monkeypatch.setattr(options_module.time, "sleep", waits.append)
    return waits


def flaky(errors: list[BaseException], answer: object = "ok"):
    """A `once` that raises each of `errors` in turn, then answers; counts its calls."""
    calls = []

    def once() -> object:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return answer

    return once, calls


def never_busy(_: object) -> None:
    return None


def test_the_backoff_doubles_and_stops_at_the_retries_and_the_timeout() -> None:
    o, now = opts(), time.monotonic()
    assert [o.delay(a, now) for a in range(4)] == [0.05, 0.1, 0.2, None]
    assert o.delay(0, now, at_least=0.7) == 0.7  # a server's Retry-After wins over a shorter backoff
    assert o.delay(0, now - 9.99) is None  # the wait would run past the call's timeout
    assert o.delay(0, now, timed_out=True) is None  # a timeout is not retried...
    assert opts(retry_timeouts=True).delay(0, now - 60, timed_out=True) == 0.05  # ...unless asked


def test_connection_errors_are_retried_then_fail_as_unavailable(slept: list[float]) -> None:
    once, calls = flaky([ConnectionError("reset"), OSError("refused")])
    assert opts().with_retries("GET x", once, never_busy) == "ok" and len(calls) == 3
    assert slept == [0.05, 0.1]
    once, calls = flaky([ConnectionError("reset")] * 5)
    with pytest.raises(Unavailable, match="GET x failed: reset"):
        opts().with_retries("GET x", once, never_busy)
    assert len(calls) == 4  # retries + 1


def test_a_timeout_is_tried_once_unless_asked(slept: list[float]) -> None:
    once, calls = flaky([TimeoutError("timed out")])
    with pytest.raises(Unavailable, match=r"no answer within 10 s"):
        opts().with_retries("GET x", once, never_busy)
    assert len(calls) == 1 and slept == []
    once, calls = flaky([TimeoutError("timed out")])
    assert opts(retry_timeouts=True).with_retries("GET x", once, never_busy) == "ok" and len(calls) == 2


def test_a_busy_answer_is_asked_again_then_returned_as_it_is(slept: list[float]) -> None:
    answers = iter([503, 503, 200])
    assert opts().with_retries("x", lambda: next(answers), lambda s: 0.3 if s == 503 else None) == 200
    assert slept == [0.3, 0.3]  # at least what the server asked for
    assert opts(retries=1).with_retries("x", lambda: 503, lambda s: 0.0) == 503  # given up: the caller raises
    assert slept == [0.3, 0.3, 0.05]


def test_an_http_503_is_retried_after_its_retry_after(slept: list[float]) -> None:
    """Over HTTP as over the data plane: a busy server's Retry-After (capped at 1 s) is waited for."""
    import socket  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from kvstore.sdk.http import HttpClient  # noqa: PLC0415

    answers = [
        b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 0.4\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 30\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: Fri, 04 Dec 2026 18:00:00 GMT\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    ]
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for answer in answers:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = HttpClient("127.0.0.1", listener.getsockname()[1], None, None, opts(retries=5))
    try:
        assert client.request("GET", "/v1/stats").status == 200
    finally:
        client.close()
        listener.close()
    thread.join(5)
    assert slept == [0.4, 1.0, 0.2]  # the server's 0.4 s; 30 s capped at 1 s; a date: the backoff (0.05 x 4)
