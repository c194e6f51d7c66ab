"""A client killed in the middle of its transfers leaves nothing behind in the server: no segment, no
connection, no half-stored blob."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from kvstore.sdk.remote import RemoteBackend

from kvstore.blob import verify_blob
from kvstore.protocol import dataplane as dp
from kvstore.protocol import shm
from tests.sdk.test_transports import memfds, wait_for
from tests.server.conftest import key, make_blob

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")

CLIENT = textwrap.dedent(
    """
    import sys
    from kvstore.sdk.remote import RemoteBackend
    from tests.server.conftest import key, make_blob
    be = RemoteBackend(sys.argv[1], transport="shm", pool_size=4)
    blob = make_blob(7, tokens=16384)  # 2 MiB
    i, leases = 0, []
    while True:
        be.batch_put([(key(1000 + (i + j) % 64), blob) for j in range(4)])
        leases.append(be.lease([key(1000 + i % 64)]))  # held, never released: the process dies with them
        if i == 2:
            print("busy", flush=True)
        i += 1
    """
)


def test_a_killed_shm_client_leaks_no_segment(server):
    plane = server.thread.server.plane
    before = memfds()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, server.url], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline() == b"busy\n"
        assert len(plane.shm) == 1 and memfds() > before
        time.sleep(0.05)  # somewhere in the middle of a put or a get
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    wait_for(lambda: len(plane.connections) == 0 and len(plane.shm) == 0)
    assert plane.shm.used == 0 and memfds() == before
    for tier in server.store.tiers:  # every stored blob is whole
        for k in tier.keys():
            verify_blob(tier.get(k))
    # the blobs it held lent in the cpu arena are free again: the whole capacity takes new blobs
    be = RemoteBackend(server.url, transport="shm")
    for i in range(30):
        assert be.put_blob(key(i), make_blob(i, tokens=16384)) == ["cpu"]
    assert all(server.store.tiers[0].contains(key(i)) for i in range(30))
    be.close()


def test_a_client_that_dies_mid_body_stores_nothing(server):
    import socket

    before = server.usage()
    blob = make_blob(1, tokens=16384)
    meta = dp.pack_meta({"k": ["ab" * 16], "l": [len(blob)]})
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(dp.PREFACE + dp.pack_head(dp.HELLO, dp.pack_meta({"v": dp.VERSION})))
        s.recv(4096)
        s.sendall(dp.pack_head(dp.PUT, meta, len(blob)) + blob[: len(blob) // 2])
        wait_for(lambda: server.thread.state.budget.used == len(blob))  # the server is reading its body
    plane = server.thread.server.plane
    wait_for(lambda: len(plane.connections) == 0)
    assert server.usage() == before
