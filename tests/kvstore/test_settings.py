"""kvstore.settings: one size parser (pydantic ByteSize rules) and one layering for every command."""

from __future__ import annotations

import pytest
from kvstore.connectors.config import KVTransferConfig
from kvstore.engine.engine_args import EngineArgs
from kvstore.server.config import ServerConfig

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.settings import load_settings, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MB", 512 * 10**6), ("512MiB", 512 * 2**20), ("8gib", 8 * 2**30), ("1.5GiB", 3 * 2**29),
     ("1000000", 10**6), (4096, 4096), ("10 KB", 10**4), ("2TiB", 2 * 2**40)],
)  # fmt: skip
def test_one_size_rule(text, size) -> None:
    assert parse_size(text) == size


def test_every_room_reads_sizes_alike() -> None:
    """'512MB' used to be 512 x 2^20 in the engine and 512 x 10^6 in the store."""
    assert EngineArgs(kv_cache_memory="512MB").kv_cache_memory == 512 * 10**6
    assert StoreConfig(cpu_capacity="512MB").cpu_capacity == 512 * 10**6
    assert ServerConfig(max_request_size="512MB").max_request_size == 512 * 10**6
    assert KVTransferConfig(local_cpu_capacity="512MB").local_cpu_capacity == 512 * 10**6


@pytest.mark.parametrize("bad", ["lots", "8Gi", "-5", "1e3", True, "", "5 potatoes"])
def test_bad_sizes_say_what_a_size_looks_like(bad) -> None:
    with pytest.raises(ConfigError, match="sizes look like 512MiB"):
        parse_size(bad)


def test_errors_are_one_sentence_not_pydantic_reports() -> None:
    with pytest.raises(ConfigError) as e:
        StoreConfig(cpu_capacity="lots", write_policy="sideways")
    text = str(e.value)
    assert "\n" not in text and "cpu_capacity: not a size: 'lots'" in text and "write_policy" in text
    assert "pydantic" not in text and "For further information" not in text
    with pytest.raises(ConfigError, match="unknown setting 'bogus'"):
        StoreConfig(bogus=1)


def test_layers_defaults_file_env_overrides(tmp_path, monkeypatch) -> None:
    f = tmp_path / "kv.yaml"
    f.write_text("tiers: [cpu]\ncpu_capacity: 1GiB\nport: 9000\nttl: 30\n")
    monkeypatch.setenv("KVSTORE_CPU_CAPACITY", "2GiB")
    monkeypatch.setenv("KVSTORE_TTL", "60")
    monkeypatch.setenv("KVSTORE_NOT_A_SETTING", "x")  # other KVSTORE_* variables are not settings
    store, server = load_settings([StoreConfig, ServerConfig], f, {"port": 9100, "host": None})
    assert store.tiers == ["cpu"] and store.cpu_capacity == 2 * 2**30 and store.ttl == 60.0
    assert server.port == 9100 and server.host == "127.0.0.1"
    monkeypatch.setenv("KVSTORE_CONFIG", str(f))  # the file when none is given
    store, _ = load_settings([StoreConfig, ServerConfig], overrides={}, env_prefix="NOPE_")
    assert store.cpu_capacity == 2**30
    with pytest.raises(ConfigError, match="unknown setting in .*kv.yaml: 'port'"):  # not a store setting
        load_settings([StoreConfig])
    monkeypatch.delenv("KVSTORE_CONFIG")
    with pytest.raises(ConfigError, match="did you mean 'cpu_capacity'"):
        load_settings([StoreConfig], overrides={"cpu_capacty": "1GiB"})


def test_store_local_and_the_server_default_to_different_directories(monkeypatch, tmp_path) -> None:
    from kvstore.sdk import Store

    monkeypatch.setenv("KVSTORE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("KVSTORE_DISK_PATH", raising=False)
    with Store.local(tiers=["cpu", "disk"]) as store:
        local_dir = store.backend.store.tiers[1].root
        # the server's default directory stays free while Store.local holds its own
        server_store, _ = load_settings([StoreConfig, ServerConfig], None, {}, use_config_env=False)
        assert local_dir != server_store.disk_path and local_dir.parent == server_store.disk_path.parent
        with pytest.raises(ConfigError, match="in use by another process.*disk_path"):
            Store.local(tiers=["disk"], disk_path=local_dir)
