"""KVTransferConfig: validation, engine layout, YAML and environment layers."""

from __future__ import annotations

import pytest
from kvstore.connectors.base import KVConnectorRole
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.factory import create_connector

from kvstore.errors import ConfigError


def test_defaults_and_sizes() -> None:
    c = KVTransferConfig(local_cpu_capacity="1GiB")
    assert (c.store_url, c.codec, c.kv_role, c.chunk_size) == ("local", "raw", "kv_both", 256)
    assert c.block_size == 16
    assert c.local_cpu_capacity == 2**30 and c.is_local and c.saves
    assert not KVTransferConfig(kv_role="decode").saves


@pytest.mark.parametrize(
    "bad",
    [
        {"codec": "zip"},
        {"kv_role": "proxy"},
        {"store_url": "redis://x"},
        {"chunk_size": 100},
        {"chunk_size": 0},
        {"save_threads": 0},
        {"local_tiers": ["cpu", "cpu"]},
        {"local_tiers": ["tape"]},
        {"local_cpu_capacity": "lots"},
        {"unreachable_backoff_s": -1},
        {"no_such_field": 1},
    ],
)
def test_bad_values_are_config_errors(bad: dict) -> None:
    with pytest.raises(ConfigError):
        KVTransferConfig(**bad)


def test_for_engine_sets_the_layout_and_checks_block_size() -> None:
    c = KVTransferConfig(chunk_size=64, namespace="tenant-a")
    e = c.for_engine(
        model_name="m", model_config_hash="h", num_layers=2, num_kv_heads=1, head_dim=8,
        kv_dtype="float16", block_size=32,
    )  # fmt: skip
    assert e.layout.chunk_size == 64 and e.layout.num_layers == 2 and e.block_size == 32
    assert e.namespace == "tenant-a" and c.layout is None
    with pytest.raises(ConfigError):
        c.for_engine(
            model_name="m", model_config_hash="h", num_layers=2, num_kv_heads=1, head_dim=8,
            kv_dtype="float16", block_size=48,
        )  # fmt: skip
    with pytest.raises(ConfigError):
        c.for_engine(
            model_name="m", model_config_hash="h", num_layers=0, num_kv_heads=1, head_dim=8,
            kv_dtype="float16", block_size=16,
        )  # fmt: skip


def test_yaml_then_env_then_overrides(tmp_path, monkeypatch) -> None:
    f = tmp_path / "kv.yaml"
    f.write_text("codec: fp8\nchunk_size: 128\nlocal_tiers: cpu,disk\n")
    monkeypatch.setenv("KVSTORE_CODEC", "int4")
    c = KVTransferConfig.load(f, kv_role="prefill", namespace=None)
    assert (c.codec, c.chunk_size, c.kv_role, c.local_tiers) == ("int4", 128, "kv_producer", ["cpu", "disk"])
    with pytest.raises(ConfigError):
        KVTransferConfig.load(tmp_path / "missing.yaml")


def test_connector_without_layout_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        create_connector("kvstore", KVConnectorRole.SCHEDULER, KVTransferConfig())
    with pytest.raises(ConfigError):
        create_connector("kvstore", KVConnectorRole.WORKER, {"store_url": "local"})
    assert create_connector("none", KVConnectorRole.WORKER, None) is None


def test_an_engine_passes_plain_fields_and_the_environment_fills_in(monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_CHUNK_SIZE", "128")
    monkeypatch.setenv("KVSTORE_RETRIES", "0")
    layout = {"model_name": "m", "model_config_hash": "h", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8}
    connector = create_connector(
        "kvstore", KVConnectorRole.SCHEDULER, {"store_url": "local", "codec": "raw", "layout": layout}
    )
    try:
        assert connector.config.chunk_size == connector.config.layout.chunk_size == 128
        assert connector.config.retries == 0 and connector.config.layout.kv_dtype == "float16"
    finally:
        connector.shutdown()
    with pytest.raises(ConfigError):
        create_connector("kvstore", KVConnectorRole.WORKER, {"store_url": "local", "bogus": 1})


def test_from_mapping_is_vllms_extra_config_over_the_environment(tmp_path, monkeypatch) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    monkeypatch.setenv("KVSTORE_CODEC", "fp8")
    monkeypatch.setenv("KVSTORE_CHUNK_SIZE", "128")
    c = KVTransferConfig.from_mapping(
        {"url": "http://127.0.0.1:8100", "token_file": str(token), "kv_role": "kv_producer", "chunk_size": 64}
    )
    assert (c.store_url, c.token(), c.kv_role, c.codec, c.chunk_size) == (
        "http://127.0.0.1:8100", "abc", "kv_producer", "fp8", 64,
    )  # fmt: skip
    assert c.is_producer and c.saves and not KVTransferConfig.from_mapping({"kv_role": "kv_consumer"}).saves
    with pytest.raises(ConfigError, match="set the same thing"):
        KVTransferConfig.from_mapping({"url": "http://a:1", "store_url": "http://b:1"})
    with pytest.raises(ConfigError, match="not both"):
        KVTransferConfig.from_mapping({"token": "x", "token_file": str(token)})
    with pytest.raises(ConfigError, match="empty"):
        (tmp_path / "empty").write_text("\n")
        KVTransferConfig.from_mapping({"token_file": str(tmp_path / "empty")}).token()
