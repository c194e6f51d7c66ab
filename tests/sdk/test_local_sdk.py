"""The SDK's `Store` in local mode, over real cpu and disk tiers: sync, async, config, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvstore.sdk import Backend, Store
from kvstore.sdk.local import LocalBackend
from kvstore.sdk.remote import RemoteBackend

from kvstore.blob import encode_blob, verify_blob
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, CorruptBlob, InvalidArgument, InvalidKey, TooLarge
from kvstore.keys import KVLayout, chunk_keys
from tests.blobs import kept

LAYOUT = KVLayout("test-model", "cafe", num_layers=2, num_kv_heads=2, head_dim=16, chunk_size=8)


def kv(seed: int, dtype: torch.dtype = torch.float16, tokens: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, tokens, 2, 16, generator=g).to(dtype)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store.local(tiers=["cpu", "disk"], disk_path=tmp_path, cpu_capacity="1MiB") as s:
        yield s


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_put_get_tensors(store: Store, dtype: torch.dtype) -> None:
    k = "ab" * 16
    x = kv(1, dtype)
    store.put(k, x)
    got = store.get(k)
    assert got is not None and got.dtype == dtype and torch.equal(got, x)
    out = torch.empty_like(x)
    assert store.get(k, out=out) is out and torch.equal(out, x)
    assert store.get("cd" * 16) is None
    verify_blob(store.get_blob(k))


def test_put_blobs_and_reject_bad_input(store: Store) -> None:
    b = encode_blob(kv(2))
    store.put("ab" * 16, b)
    store.put("cd" * 16, bytearray(b))
    assert store.get_blob("cd" * 16) == kept(b, "cd" * 16)  # kept bound to its key
    with pytest.raises(CorruptBlob):
        store.put("ef" * 16, b[:-1])
    with pytest.raises(InvalidArgument):
        store.put("ef" * 16, [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        store.put("ef" * 16, torch.zeros(3, 3))
    with pytest.raises(InvalidKey):
        store.put("EF" * 16, b)
    assert not store.exists("ef" * 16)


def test_a_prompt_round_trip_with_lookup_prefix(store: Store) -> None:
    tokens = list(range(100, 140))  # 5 chunks of 8
    keys = chunk_keys(tokens, LAYOUT)
    chunks = [kv(i) for i in range(len(keys))]
    store.batch_put(list(zip(keys[:3], chunks[:3], strict=True)))
    assert store.lookup_prefix(keys) == 3
    store.put(keys[4], encode_blob(chunks[4]))  # after a gap: does not extend the prefix
    assert store.lookup_prefix(keys) == 3
    assert store.batch_exists(keys) == [True, True, True, False, True]
    got = store.batch_get(keys)
    assert got[3] is None and all(torch.equal(g, c) for g, c in zip(got[:3], chunks[:3], strict=True))
    # a second prompt sharing the first two chunks finds exactly those
    other = tokens[:16] + [7] * 24
    assert store.lookup_prefix(chunk_keys(other, LAYOUT)) == 2
    assert store.delete(keys[0]) and store.lookup_prefix(keys) == 0
    stats = store.stats()
    assert stats["hits"] == 4 and stats["misses"] == 1 and stats["tiers"][0]["name"] == "cpu"


async def test_async_twins(store: Store) -> None:
    keys = chunk_keys(list(range(24)), LAYOUT)
    await store.aput(keys[0], kv(0))
    await store.abatch_put([(keys[1], kv(1)), (keys[2], encode_blob(kv(2)))])
    assert torch.equal(await store.aget(keys[1]), kv(1))
    assert await store.aget("00" * 16) is None
    assert (await store.aget_blob(keys[2])) == kept(encode_blob(kv(2)), keys[2])
    assert await store.aexists(keys[0]) and not await store.aexists("00" * 16)
    assert await store.alookup_prefix(keys) == 3
    got = await store.abatch_get([keys[2], "00" * 16])
    assert torch.equal(got[0], kv(2)) and got[1] is None
    assert await store.abatch_exists(keys) == [True, True, True]
    assert await store.adelete(keys[1])
    assert await store.alookup_prefix(keys) == 1
    assert (await store.astats())["tiers"][1]["name"] == "disk"
    with pytest.raises(CorruptBlob):
        await store.aput(keys[1], b"nope")


async def test_async_context_manager(tmp_path: Path) -> None:
    async with Store.local(tiers=["cpu"]) as s:
        await s.aput("ab" * 16, kv(0))
        assert await s.aexists("ab" * 16)


def test_backend_protocol_and_warm_restart(tmp_path: Path) -> None:
    with Store.local(tiers=["cpu", "disk"], disk_path=tmp_path) as s:
        assert isinstance(s.backend, LocalBackend) and isinstance(s.backend, Backend)
        s.put("ab" * 16, kv(3))
    with Store.local(tiers=["cpu", "disk"], disk_path=tmp_path) as s:  # a new process would see the same
        assert torch.equal(s.get("ab" * 16), kv(3))
        assert s.stats()["tiers"][1]["hits"] == 1


def test_config_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml_file = tmp_path / "store.yaml"
    yaml_file.write_text(f"tiers: [cpu, disk]\ncpu_capacity: 2MiB\ndisk_path: {tmp_path / 'd'}\n")
    monkeypatch.setenv("KVSTORE_CPU_CAPACITY", "3MiB")
    monkeypatch.setenv("KVSTORE_TIERS", "cpu")
    with Store.local() as s:  # environment over defaults
        tiers = s.backend.store.tiers
        assert [t.name for t in tiers] == ["cpu"] and tiers[0].capacity == 3 * 2**20
    monkeypatch.delenv("KVSTORE_TIERS")
    with Store.local(config=yaml_file) as s:  # a YAML path: YAML < env
        tiers = s.backend.store.tiers
        assert [t.name for t in tiers] == ["cpu", "disk"] and tiers[0].capacity == 3 * 2**20
        assert tiers[1].root == tmp_path / "d"
    config = StoreConfig.load(yaml_file)  # env (3MiB) over YAML (2MiB)
    with Store.local(config=config, max_blob_size=4096) as s:  # explicit overrides over config
        store = s.backend.store
        assert [t.name for t in store.tiers] == ["cpu", "disk"] and store.tiers[0].capacity == 3 * 2**20
        with pytest.raises(TooLarge):
            s.put("ab" * 16, kv(0, tokens=64))
    with pytest.raises(ConfigError):
        Store.local(tiers=["cpu", "cpu"])
    with pytest.raises(ConfigError):
        Store.local(config=config, cpu_capacity="lots")
    with pytest.raises(ConfigError):
        Store.local(no_such_option=1)


def test_codec_is_configurable(tmp_path: Path) -> None:
    with Store.local(tiers=["cpu"], codec="no-such-codec") as s, pytest.raises(InvalidArgument):
        s.put("ab" * 16, kv(0))


def test_connect_delegates_to_the_remote_backend() -> None:
    s = Store.connect("http://127.0.0.1:9", token="t", codec="raw")
    assert isinstance(s.backend, RemoteBackend) and isinstance(s.backend, Backend)
    s.close()
    with pytest.raises(InvalidArgument):
        Store.connect("ftp://nowhere")
