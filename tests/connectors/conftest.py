"""Fixtures: a real kvstore-server in a subprocess (free port, always stopped), spies on a store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`python -m kvstore.server` on 127.0.0.1:0; `url` is read from its 'listening on' line."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, port: int = 0) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "kvstore.server", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--shutdown-timeout", "3", *self.args]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on (https?://\S+)", line)
            if m:
                self.url = m.group(1)
                threading.Thread(target=self._drain, daemon=True).start()
                return self
        self.stop()
        raise RuntimeError("kvstore-server did not start:\n" + "".join(lines))

    def _drain(self) -> None:
        for _ in self.proc.stdout:
            pass

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[-1].split("/")[0])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def kv_server() -> Iterator[ServerProcess]:
    """A server of this test's own (it may kill it)."""
    server = ServerProcess("--tiers", "cpu", "--cpu-capacity", "256MiB").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_server() -> Iterator[ServerProcess]:
    """One server for the tests that only put and get (keys are content-addressed: no cross-talk)."""
    server = ServerProcess("--tiers", "cpu", "--cpu-capacity", "1GiB").start()
    try:
        yield server
    finally:
        server.stop()


class Spy:
    """Forwards every call to the real store; counts calls and can hold `batch_put` until released."""

    def __init__(self, store: object) -> None:
        self._store = store
        self.calls: dict[str, int] = {}
        self.release = threading.Event()
        self.release.set()

    def __getattr__(self, name: str):
        target = getattr(self._store, name)
        if not callable(target):
            return target

        def call(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name == "batch_put":
                assert self.release.wait(30), "the test never released batch_put"
            return target(*args, **kwargs)

        return call


@pytest.fixture
def spy_store():
    """spy_store(engine) wraps the store behind an engine's connectors (both roles share it)."""
    wrapped = []

    def wrap(engine) -> Spy:
        handle = engine.scheduler.handle
        spy = Spy(handle.store)
        handle.store = spy
        wrapped.append((handle, spy))
        return spy

    yield wrap
    for handle, spy in wrapped:
        spy.release.set()
        handle.store = spy._store


@pytest.fixture
def engines():
    """engines(config, **kw) -> MiniEngine; every engine made is shut down after the test."""
    from tests.connectors.sim import MiniEngine  # noqa: PLC0415

    made = []

    def make(config, **kw):
        engine = MiniEngine(config, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.shutdown()


@pytest.fixture(scope="session")
def off():
    """SmolLM2 without the store: the reference every store-on output must equal token for token."""
    from tests.connectors.engine_util import llm  # noqa: PLC0415 (engine tests only)

    engine = llm()
    yield engine
    engine.shutdown()
