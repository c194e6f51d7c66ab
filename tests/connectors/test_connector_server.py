"""The connector through a real kvstore-server: hits across engines, and across a server restart."""

from __future__ import annotations

import pytest
import torch

from tests.connectors.conftest import ServerProcess
from tests.connectors.sim import Req, make_config, prompt, truth_kv


def test_hit_through_the_server_is_bit_exact(engines, shared_server) -> None:
    config = make_config("float16", store_url=shared_server.url)
    a, b = engines(config, seed=1), engines(config, seed=2)
    tokens = prompt(900, seed=1)
    a.prefill(Req("r1", tokens))
    a.worker.flush()
    req = Req("r2", tokens)
    assert b.prefill(req) == 768
    assert torch.equal(b.read(req, 0, 900), truth_kv(tokens, 0, 900, torch.float16))
    snap = b.worker.metrics.snapshot()
    assert snap["kvstore_connector_load_bytes_total"] == snap["kvstore_connector_save_bytes_total"] > 0


@pytest.mark.slow
def test_disk_tier_survives_a_server_restart(engines, tmp_path) -> None:
    args = ("--tiers", "cpu,disk", "--cpu-capacity", "64MiB", "--disk-path", str(tmp_path / "disk"))
    server = ServerProcess(*args).start()
    try:
        config = make_config(store_url=server.url)
        a = engines(config, seed=1)
        tokens = prompt(600, seed=2)
        a.prefill(Req("r1", tokens))
        a.worker.flush()
        port = server.port
        server.kill()  # SIGKILL: every acknowledged chunk is on disk already
        server = ServerProcess(*args).start(port=port)  # same URL: the engine's config is unchanged
        b = engines(config, seed=2)
        req = Req("r2", tokens)
        assert b.prefill(req) == 512
        assert torch.equal(b.read(req, 0, 600), truth_kv(tokens, 0, 600, torch.float32))
        assert not b.load_errors
    finally:
        server.stop()
