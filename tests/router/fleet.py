"""A small fleet of real processes: one kvstore-server and SmolLM2 engines sharing it, each publishing
KV events on ipc:// endpoints, and `kvstore-engine router` in front (tests and benchmarks/bench_router.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from tests.connectors.conftest import ServerProcess
from tests.connectors.engine_util import free_port
from tests.connectors.test_engine_pd import Proc, http_json
from tests.waiting import wait_until


def events_config(tmp: Path, name: str) -> dict:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp}/{name}-pub",
        "replay_endpoint": f"ipc://{tmp}/{name}-replay",
    }


def start_store(tmp: Path, *args: str) -> tuple[ServerProcess, dict]:
    cfg = events_config(tmp, "store")
    server = ServerProcess(
        "--tiers", "cpu", "--cpu-capacity", "512MiB", "--kv-events-config", json.dumps(cfg), *args
    )
    return server.start(), cfg


def start_engine(tmp: Path, name: str, store_url: str | None, *args: str) -> tuple[Proc, str, dict]:
    """An engine on the kvstore-server at `store_url` (None: its own prefix cache only)."""
    cfg = events_config(tmp, name)
    port = free_port()
    store = ["--kv-backend", "kvstore", "--kv-store-url", store_url] if store_url else []
    proc = Proc([
        "serve", "--port", str(port), *store, "--num-threads", "1", "--kv-events-config", json.dumps(cfg), *args,
    ])  # fmt: skip
    proc.drain()
    return proc, f"http://127.0.0.1:{port}", cfg


def wait_healthy(url: str, proc: Proc, timeout_s: float = 300) -> None:
    def healthy() -> bool:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {''.join(proc.tail)[-3000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False
        return True

    wait_until(healthy, timeout_s, 0.3, RuntimeError, f"{url} becoming healthy")


def start_router(engines: list[tuple[str, dict]], store_cfg: dict | None, *args: str) -> tuple[Proc, str]:
    cmd = ["router", "--port", "0", "--calibrate-interval", "1"]
    for url, cfg in engines:
        cmd += [
            "--engine",
            url,
            "--engine-events",
            cfg["endpoint"],
            "--engine-replay",
            cfg["replay_endpoint"],
        ]
    if store_cfg:
        cmd += ["--store-events", store_cfg["endpoint"], "--store-replay", store_cfg["replay_endpoint"]]
    cmd += args
    proc = Proc(cmd)
    try:
        url = proc.wait_line(r"listening on (http://\S+)", timeout=120).group(1)
        wait_healthy(url, proc, 60)  # 200 once every publisher's replay was read
    except BaseException:
        proc.stop()
        raise
    return proc, url


def router_state(url: str) -> dict:
    return http_json(url + "/v1/router/state")


def post(url: str, path: str, body: dict, timeout: float = 300) -> tuple[dict, dict]:
    """(the JSON answer, its headers)."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read()), dict(resp.headers)
