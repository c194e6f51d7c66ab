"""Each server says where it listens once (issue 43: "'listening on' is printed twice"), on stdout, with
the bound port when started with --port 0: kvstore-server, `kvstore-engine serve` and `kvstore-engine
router`. Scripts and tests read the first `listening on (http://...)` line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
URL = re.compile(r"listening on (http://\S+)")


def _run_until_listening(args: list[str], timeout: float = 120) -> tuple[str, str, str]:
    """Start `python -m ...args` with INFO logs, read stdout to its `listening on` line, stop it with
    SIGTERM and return (that line, all stdout, all stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", *args, "--log-level", "INFO"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        first = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if URL.search(line):
                first = line
                break
        time.sleep(0.5)  # anything it would log right after binding
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first, f"no 'listening on' line: {err[-2000:]}"
    return first, first + out, err


def _check_once(first: str, out: str, err: str, prefix: str) -> None:
    assert first.startswith(prefix), first
    port = int(URL.search(first).group(1).rsplit(":", 1)[1])
    assert port > 0, "the bound port, not --port 0"
    both = out + err
    assert both.count("listening on") == 1, both


def test_kvstore_server_says_where_it_listens_once() -> None:
    first, out, err = _run_until_listening(["kvstore.server", "--port", "0", "--tiers", "cpu"])
    _check_once(first, out, err, "kvstore-server listening on http://127.0.0.1:")
    assert first.split()[-1] == URL.search(first).group(1), "the URL ends the line (tests split it off)"
    assert "tiers cpu" in err, "the log still says which tiers it serves"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.engine.conftest import make_tiny_engine_dir

    return make_tiny_engine_dir(tmp_path_factory.mktemp("listening") / "tiny")


def test_engine_serve_says_where_it_listens_once_with_the_bound_port(tiny_model: Path) -> None:
    first, out, err = _run_until_listening(["kvstore.engine", "serve", "--model", str(tiny_model), "--port", "0",
                                            "--kv-cache-memory", "4MiB", "--max-model-len", "128"])  # fmt: skip
    _check_once(first, out, err, "kvstore-engine serve (tiny) listening on http://127.0.0.1:")
    assert ":0/" not in out + err and ":0 " not in out + err, "no line names port 0"


def test_router_says_where_it_listens_once(tiny_model: Path, tmp_path: Path) -> None:
    args = ["kvstore.engine", "router", "--model", str(tiny_model), "--port", "0", "--engine", "http://127.0.0.1:9",
            "--engine-events", f"ipc://{tmp_path}/e-pub", "--calibrate-interval", "0"]  # fmt: skip
    first, out, err = _run_until_listening(args)
    _check_once(first, out, err, "kvstore-engine router listening on http://127.0.0.1:")
