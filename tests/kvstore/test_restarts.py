"""Restarts of a real kvstore-server process never bring back a deleted or an older blob: a restart
while Valkey is down (the invalidations are kept in the state directory), and SIGTERM with
`--write-policy back` while writers replace keys (what the drain could not flush is a miss, never an
older version)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from kvstore.sdk.remote import RemoteBackend

from kvstore.errors import KVStoreError
from tests.blobs import kept
from tests.server import test_cli
from tests.server.conftest import key, make_blob
from tests.server.test_cli import CliServer, _env
from tests.valkey import wait_until

cli_servers = test_cli.cli_servers  # the fixture: servers started by a test, killed after it
DURABLE = ("--appendonly", "yes", "--appendfsync", "always")  # Valkey keeps its data through a SIGKILL


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_server_restarted_during_a_valkey_outage_keeps_its_invalidations(
    valkey_factory,
    tmp_path: Path,
    cli_servers,
    sig: int,
) -> None:
    valkey = valkey_factory(*DURABLE)
    env = _env(KVSTORE_STATE_DIR=str(tmp_path / "state"))
    args = ["--tiers", "cpu,redis", "--redis-url", valkey.url, "--redis-prefix", "rs:"]
    first = CliServer(*args, env=env)
    cli_servers.append(first)
    be = RemoteBackend(first.url, retries=0)
    assert be.put_blob(key(1), make_blob(1)) == ["cpu", "redis"]
    assert be.put_blob(key(2), make_blob(2)) == ["cpu", "redis"]
    valkey.kill()
    assert be.delete(key(1)) is True  # 204: remembered
    assert be.put_blob(key(2), make_blob(22)) == ["cpu"]  # 201 in cpu: the old blob invalidated
    be.close()
    first.stop(sig)
    second = CliServer(*args, env=env)  # Valkey still down; the new process has an empty cpu tier
    cli_servers.append(second)
    be = RemoteBackend(second.url, retries=0)
    try:
        valkey.start()  # the AOF brings both old blobs back
        with valkey.client() as c:
            assert c.get("rs:" + key(1)) == kept(make_blob(1), key(1))

        def replayed() -> bool:  # from the moment Valkey answers until the replay: misses, never old
            assert be.get_blob(key(1)) is None and be.get_blob(key(2)) is None
            with valkey.client() as c:
                return c.exists("rs:" + key(1), "rs:" + key(2)) == 0

        wait_until(replayed, interval=0)
        assert be.get_blob(key(1)) is None and be.get_blob(key(2)) is None
    finally:
        be.close()


def test_sigterm_with_write_back_during_writers_never_serves_an_older_version(
    tmp_path: Path,
    cli_servers,
) -> None:
    disk = str(tmp_path / "disk")
    n_keys, writers = 32, 4
    seeder = CliServer("--tiers", "cpu,disk", "--disk-path", disk)  # v0 of every key on disk
    cli_servers.append(seeder)
    be = RemoteBackend(seeder.url, retries=0)
    be.batch_put([(key(i), make_blob(i)) for i in range(n_keys)])
    be.close()
    assert seeder.stop() == 0
    server = CliServer("--tiers", "cpu,disk", "--disk-path", disk, "--write-policy", "back",
                       "--write-back-queue", "2", "--shutdown-timeout", "5")  # fmt: skip
    cli_servers.append(server)
    acked = [0] * n_keys  # the newest version acknowledged for each key
    tried = [0] * n_keys  # the newest version sent (its answer may have been cut by the SIGTERM)
    stop = threading.Event()

    def write(w: int) -> None:
        client = RemoteBackend(server.url, retries=0, timeout=10)
        try:
            for v in range(1, 10_000):
                if stop.is_set():
                    return
                mine = list(range(w, n_keys, writers))
                for i in mine:
                    tried[i] = v
                client.batch_put([(key(i), make_blob(1000 * v + i)) for i in mine])
                for i in mine:
                    acked[i] = v
        except (KVStoreError, OSError):
            return  # the server went away
        finally:
            client.close()

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    wait_until(lambda: min(acked) >= 3, timeout=60)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.stop(timeout=30) == 0
    assert time.monotonic() - t0 < 5 + 10  # the drain is bounded by --shutdown-timeout
    stop.set()
    for t in threads:
        t.join(30)
    again = CliServer("--tiers", "disk", "--disk-path", disk)  # only the disk: no cpu copy to hide behind
    cli_servers.append(again)
    be = RemoteBackend(again.url, retries=0)
    got = be.batch_get([key(i) for i in range(n_keys)])
    be.close()
    older = []
    for i, b in enumerate(got):
        if b is None:
            continue
        newer = {kept(make_blob(1000 * v + i), key(i)) for v in range(acked[i], tried[i] + 1)} | (
            {kept(make_blob(i), key(i))} if acked[i] == 0 else set()
        )
        if bytes(b) not in newer:
            older.append(i)
    assert older == [], f"{len(older)} keys served a version older than their acknowledged one"
