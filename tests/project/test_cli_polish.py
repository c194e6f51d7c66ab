"""Both commands, as a user meets them: --version, a taken port is one line, a bad value is one
sentence, --log-level after the subcommand, and every setting has a flag."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from kvstore.server.cli import build_parser
from kvstore.server.config import ServerConfig

from kvstore import __version__
from kvstore.config import StoreConfig

ROOT = Path(__file__).resolve().parents[2]


def run(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", f"kvstore.{module}", *args], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("module", ["server", "engine"])
def test_version(module: str) -> None:
    r = run(module, "--version")
    assert r.returncode == 0 and r.stdout.strip().endswith(__version__)


def test_server_port_in_use_is_one_line(taken_port: int, tmp_path: Path) -> None:
    r = run("server", "--port", str(taken_port), "--tiers", "cpu,disk", "--disk-path", str(tmp_path / "d"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr.strip()
        == f"kvstore-server: port {taken_port} on 127.0.0.1 is in use; stop what holds it or choose another --port"
    )
    assert "listening" not in r.stdout and not (tmp_path / "d").exists(), "checked before the store opens"


def test_engine_port_in_use_is_one_line_before_the_model_loads(taken_port: int) -> None:
    r = run("engine", "serve", "--port", str(taken_port), "--model", "/no/such/model")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"kvstore-engine: error: port {taken_port} on 127.0.0.1 is in use; stop what holds it or choose another --port"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu-capacity", "lots"], "cpu_capacity: not a size: 'lots' (sizes look like 512MiB"),
        (["--tiers", "cpu,tape"], "tiers"),
        (["--port", "http"], "port"),
        (["--write-policy", "sideways"], "write_policy"),
    ],
)
def test_server_bad_values_are_one_sentence(args: list[str], message: str) -> None:
    r = run("server", *args)
    assert r.returncode == 2 and message in r.stderr
    assert (
        len(r.stderr.strip().splitlines()) == 1 and "pydantic" not in r.stderr and "Traceback" not in r.stderr
    )


def test_engine_log_level_goes_before_or_after_the_subcommand() -> None:
    for args in (
        ["--log-level", "info", "generate", "--help"],
        ["generate", "--log-level", "info", "--help"],
    ):
        assert run("engine", *args).returncode == 0
    r = run("engine", "generate", "--log-level", "loud", "--prompt", "x")
    assert r.returncode == 2 and "choose one of DEBUG, INFO, WARNING, ERROR" in r.stderr


def test_every_server_setting_has_a_flag() -> None:
    flags = {a.dest for a in build_parser()._actions}
    missing = (set(StoreConfig.model_fields) | set(ServerConfig.model_fields)) - flags
    assert missing == set()
