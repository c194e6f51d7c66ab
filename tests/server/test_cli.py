"""`kvstore-server` as users run it: a subprocess, port 0, YAML/env/flags, SIGTERM that flushes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvstore.sdk.remote import RemoteBackend
from kvstore.server.cli import build_parser, main
from kvstore.server.config import load_configs

from kvstore.errors import ConfigError
from kvstore.protocol import wire
from tests.blobs import kept
from tests.server.conftest import key, make_blob, read_response
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


class CliServer:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "kvstore.server", "--port", "0", "--log-level", "WARNING", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env or _env(), cwd=ROOT)  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise AssertionError(f"server did not start: {line!r} {self.proc.stderr.read()!r}")
        self.url = line.split()[-1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def cli_servers() -> Iterator[list[CliServer]]:
    started: list[CliServer] = []
    yield started
    for s in started:
        s.stop(signal.SIGKILL)


def test_help_runs_as_a_module():
    run = subprocess.run([sys.executable, "-m", "kvstore.server", "--help"], capture_output=True, text=True,
                         env=_env(), cwd=ROOT, timeout=60)  # fmt: skip
    assert run.returncode == 0 and "--auth-token-file" in run.stdout and "--tiers" in run.stdout


@pytest.mark.parametrize(
    "bad",
    [["--tiers", "cpu,cpu"], ["--tiers", "tape"], ["--port", "99999"], ["--tls-cert", "x.pem"],
     ["--cpu-capacity", "lots"], ["--auth-token-file", "/nonexistent/token"], ["--max-request-size", "-1"]],
)  # fmt: skip
def test_bad_flags_exit_2_with_one_line(bad, capsys, monkeypatch):
    for name in [k for k in os.environ if k.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstore-server: ") and "Traceback" not in err


@pytest.mark.slow
def test_sigterm_flushes_write_back_to_disk(tmp_path, cli_servers):
    """Write-back puts acknowledged before SIGTERM are on disk after it: a new server serves them."""
    disk = str(tmp_path / "disk")
    args = ["--tiers", "cpu,disk", "--disk-path", disk, "--write-policy", "back", "--cpu-capacity", "32MiB"]
    first = CliServer(*args)
    cli_servers.append(first)
    be = RemoteBackend(first.url)
    items = [(key(i), make_blob(i, tokens=256)) for i in range(40)]
    be.batch_put(items)
    be.close()
    assert first.stop() == 0
    assert len(list(Path(disk).rglob("*"))) > 40  # blob files (plus shard directories)
    second = CliServer(
        "--tiers", "disk", "--disk-path", disk
    )  # only the disk tier: no cpu copy to hide behind
    cli_servers.append(second)
    be = RemoteBackend(second.url)
    assert [bytes(b) for b in be.batch_get([k for k, _ in items])] == [kept(b, k) for k, b in items]
    be.close()
    assert second.stop(signal.SIGINT) == 0


def _body_bytes_in_flight(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return float(re.search(r"^kvstore_http_body_bytes_in_flight (\S+)$", text, re.M).group(1))


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_in_flight_request_finishes_on_sigterm(tmp_path, cli_servers):
    srv = CliServer("--tiers", "cpu", "--shutdown-timeout", "20")
    cli_servers.append(srv)
    blob = make_blob(1)
    head = f"PUT {wire.chunk_path(key(1))} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nContent-Length: {len(blob)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(head.encode() + blob[:100])
        wait_until(lambda: _body_bytes_in_flight(srv.url) > 0)  # the handler waits for the rest of the body
        srv.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not _accepts(srv.port))  # no longer accepting
        s.sendall(blob[100:])
        r = read_response(s)
        assert r.status == 201
    assert srv.stop() == 0


def test_config_file_env_and_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "kvstore.yaml"
    cfg.write_text("tiers: [cpu]\ncpu_capacity: 1GiB\nport: 9000\nhost: 0.0.0.0\nsample_interval: 2\n")
    monkeypatch.setenv("KVSTORE_PORT", "9100")
    monkeypatch.setenv("KVSTORE_CPU_CAPACITY", "2GiB")
    store, server = load_configs(cfg)
    assert store.tiers == ["cpu"] and store.cpu_capacity == 2 * 2**30  # env beats the file
    assert server.port == 9100 and server.host == "0.0.0.0" and server.sample_interval == 2
    args = build_parser().parse_args(["--port", "9200", "--tiers", "cpu,disk", "--max-request-size", "8MiB"])
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "log_level") and v is not None}
    store, server = load_configs(cfg, **overrides)
    assert server.port == 9200 and store.tiers == ["cpu", "disk"] and server.max_request_size == 8 * 2**20
    cfg.write_text("tiers: [cpu]\nbogus: 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        load_configs(cfg)
    cfg.write_text("- just a list\n")
    with pytest.raises(ConfigError):
        load_configs(cfg)


def test_defaults_bind_loopback_with_cpu_and_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSTORE_DATA_DIR", str(tmp_path))
    for name in [k for k in os.environ if k.startswith("KVSTORE_") and k != "KVSTORE_DATA_DIR"]:
        monkeypatch.delenv(name)
    store, server = load_configs()
    assert store.tiers == ["cpu", "disk"] and server.host == "127.0.0.1" and server.auth_token is None
    assert str(store.disk_path).startswith(str(tmp_path))


@pytest.mark.slow
def test_cli_reads_config_file_and_env(tmp_path, cli_servers):
    cfg = tmp_path / "kvstore.yaml"
    cfg.write_text(f"tiers: [cpu, disk]\ndisk_path: {tmp_path / 'disk'}\nauth_token: from-file\n")
    srv = CliServer("--config", str(cfg), env=_env(KVSTORE_CPU_CAPACITY="3MiB"))
    cli_servers.append(srv)
    be = RemoteBackend(srv.url, token="from-file")
    stats = be.stats()
    assert [t["name"] for t in stats["tiers"]] == ["cpu", "disk"] and stats["tiers"][0][
        "capacity"
    ] == 3 * 2**20
    be.close()
    assert srv.stop() == 0


def test_every_option_of_help_says_what_it_does_and_its_default():
    """Issue 30 #17: `--cpu-shared` and `--redis-max-invalidated` had no description, four size flags
    said "(default)" with no value, `--max-body-bytes-in-flight` and `--shm-budget` no default."""
    from kvstore.server.config import ServerConfig  # noqa: PLC0415

    from kvstore.config import StoreConfig  # noqa: PLC0415

    actions = {a.dest: a for a in build_parser()._actions}
    for model in (StoreConfig, ServerConfig):
        for name, field in model.model_fields.items():
            text = actions[name].help or ""
            assert len(text) > len(name) + 8 and text != name.replace("_", " "), f"--{name}: {text!r}"
            assert not re.search(r"\(default[);]", text), f"--{name} names no default value: {text!r}"
            default = field.default if field.default_factory is None else field.default_factory()
            if default is None or default == []:
                continue
            if isinstance(default, bool):
                shown = "on" if default else "off"
            elif isinstance(default, int) and "size" in str(field.metadata):  # Size fields parse '8GiB'
                shown = next(
                    f"{default >> s}{u}" for s, u in ((30, "GiB"), (20, "MiB")) if default % (1 << s) == 0
                )
            elif isinstance(default, Path):
                shown = str(default).replace(str(Path.home()), "~")
            elif isinstance(default, float):
                shown = f"{default:g}"
            elif isinstance(default, list):
                shown = ",".join(default)
            else:
                shown = str(default)
            assert shown in text, f"--{name} does not show its default {shown}: {text!r}"


def test_the_servers_cpu_memory_is_an_arena_with_shared_memory_cuda_or_not() -> None:
    """Issue 35 #5: `--cpu-memory auto` is an arena whenever shared memory is on (a GPU host too, where
    the tier used to pin itself and build none); `arena` without shared memory is a ConfigError;
    an explicit choice is kept."""
    from kvstore.server.config import ServerConfig  # noqa: PLC0415
    from kvstore.server.runner import server_cpu_memory  # noqa: PLC0415

    from kvstore.config import StoreConfig  # noqa: PLC0415
    from kvstore.protocol import shm  # noqa: PLC0415

    on, off = ServerConfig(), ServerConfig(shm_budget=0)
    if shm.available():
        assert server_cpu_memory(StoreConfig(), on) == "arena"
        assert server_cpu_memory(StoreConfig(cpu_memory="arena"), on) == "arena"
    assert server_cpu_memory(StoreConfig(), off) == "auto"  # the tier decides: pinned with CUDA
    assert server_cpu_memory(StoreConfig(cpu_memory="plain"), on) == "plain"
    with pytest.raises(ConfigError, match="--cpu-memory arena needs shared memory"):
        server_cpu_memory(StoreConfig(cpu_memory="arena"), off)
    assert build_parser().parse_args(["--cpu-memory", "plain"]).cpu_memory == "plain"
    assert load_configs(None, cpu_memory="plain")[0].cpu_memory == "plain"
