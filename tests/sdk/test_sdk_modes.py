"""One suite, two modes: `Store.local(...)` and `Store.connect(url)` against a real kvstore-server
(in-process, on a free port, always stopped) must behave the same, sync and async."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kvstore.sdk.store import Store
from kvstore.server.config import ServerConfig
from kvstore.server.runner import ServerThread

from kvstore.blob import encode_blob
from kvstore.config import StoreConfig
from kvstore.errors import CorruptBlob, InvalidArgument, InvalidKey, TooLarge
from kvstore.keys import KVLayout, chunk_keys
from kvstore.store import TieredStore
from tests.blobs import kept

LAYOUT = KVLayout("test-model", "0" * 32, num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=16)
MAX_BLOB = 256 * 1024


def kv(seed: int, tokens: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYOUT.num_layers, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g).half()


def keys(n: int, seed: int = 0) -> list[str]:
    tokens = torch.randint(0, 30000, (n * LAYOUT.chunk_size,), generator=torch.Generator().manual_seed(seed))
    return chunk_keys(tokens.numpy(), LAYOUT)


@pytest.fixture(params=["local", "remote"])
def store(request, tmp_path) -> Iterator[Store]:
    config = StoreConfig(tiers=["cpu", "disk"], cpu_capacity="1MiB", disk_path=tmp_path / "disk",
                         max_blob_size=MAX_BLOB)  # fmt: skip
    if request.param == "local":
        s = Store.local(config=config)
        yield s
        s.close()
        return
    tiered = TieredStore(config)
    with ServerThread(tiered, config, ServerConfig(port=0), close_store=True) as srv:
        s = Store.connect(srv.url, timeout=10, retries=1)
        yield s
        s.close()


def test_put_get_roundtrip_bit_exact(store):
    k = keys(1)[0]
    x = kv(1)
    assert store.get(k) is None and not store.exists(k)
    store.put(k, x)
    assert store.exists(k)
    y = store.get(k)
    assert y is not None and y.dtype == x.dtype and torch.equal(y, x)
    assert bytes(store.get_blob(k)) == encode_blob(x, key=k)  # the SDK binds a blob to its key


def test_put_blob_and_delete(store):
    k = keys(1)[0]
    blob = encode_blob(kv(2))
    store.put(k, blob)
    assert bytes(store.get_blob(k)) == kept(blob, k)  # a blob bound to no key: kept bound to k
    assert store.delete(k) is True
    assert store.delete(k) is False
    assert store.get(k) is None


def test_batches_keep_order_and_misses(store):
    ks = keys(5)
    xs = [kv(i, tokens=8 + i) for i in range(5)]
    store.batch_put([(k, x) for k, x in zip(ks[:4], xs[:4], strict=True)])
    got = store.batch_get([ks[3], ks[4], ks[0]])
    assert torch.equal(got[0], xs[3]) and got[1] is None and torch.equal(got[2], xs[0])
    assert store.batch_exists(ks) == [True, True, True, True, False]
    assert store.batch_get([]) == [] and store.batch_exists([]) == []
    store.batch_put([])


def test_lookup_prefix_stops_at_first_gap(store):
    ks = keys(6, seed=3)
    for i in (0, 1, 2, 4, 5):
        store.put(ks[i], kv(i))
    assert store.lookup_prefix(ks) == 3
    assert store.lookup_prefix(ks[3:]) == 0
    assert store.lookup_prefix([]) == 0
    store.put(ks[3], kv(3))
    assert store.lookup_prefix(ks) == 6


def test_stats_count_hits_and_misses(store):
    ks = keys(2, seed=4)
    store.put(ks[0], kv(0))
    store.get(ks[0])
    store.get(ks[1])
    s = store.stats()
    assert [t["name"] for t in s["tiers"]] == ["cpu", "disk"]
    assert s["hits"] == 1 and s["misses"] == 1
    assert s["tiers"][0]["keys"] == 1 and s["tiers"][1]["keys"] == 1  # written through to disk


def test_eviction_to_disk_and_promotion(store):
    ks = keys(12, seed=5)
    xs = [kv(i, tokens=1024) for i in range(12)]  # 128 KiB each: 1.5 MiB in all, over the 1 MiB cpu tier
    store.batch_put(list(zip(ks, xs, strict=True)))
    cpu = store.stats()["tiers"][0]
    assert cpu["evictions"] > 0 and cpu["keys"] < 12
    assert all(torch.equal(store.get(k), x) for k, x in zip(ks, xs, strict=True))  # from disk if evicted
    after = store.stats()
    assert after["tiers"][1]["hits"] > 0 and after["misses"] == 0


@pytest.mark.parametrize(
    "bad,exc",
    [("XYZ", InvalidKey), ("A" * 32, InvalidKey), ("a" * 31, InvalidKey)],
)
def test_bad_keys_raise_invalid_key(store, bad, exc):
    with pytest.raises(exc):
        store.get(bad)
    with pytest.raises(exc):
        store.put(bad, kv(0))
    with pytest.raises(exc):
        store.exists(bad)
    with pytest.raises(exc):
        store.batch_get([keys(1)[0], bad])
    with pytest.raises(exc):
        store.lookup_prefix([bad])


def test_corrupt_and_oversized_blobs_are_refused(store):
    k = keys(1, seed=6)[0]
    blob = bytearray(encode_blob(kv(0)))
    blob[-1] ^= 1
    with pytest.raises(CorruptBlob):
        store.put(k, bytes(blob))
    with pytest.raises(CorruptBlob):
        store.backend.put_blob(k, bytes(blob))  # past the SDK's own check: the store (or server) refuses
    with pytest.raises(TooLarge):
        store.put(k, kv(1, tokens=8192))  # 512 KiB > max_blob_size
    with pytest.raises(InvalidArgument):
        store.put(k, "not a tensor")  # type: ignore[arg-type]
    assert not store.exists(k)


async def test_async_twins(store):
    ks = keys(3, seed=7)
    xs = [kv(i) for i in range(3)]
    await store.aput(ks[0], xs[0])
    assert torch.equal(await store.aget(ks[0]), xs[0])
    assert await store.aget(ks[1]) is None
    assert await store.aexists(ks[0]) and not await store.aexists(ks[1])
    await store.abatch_put([(ks[1], xs[1]), (ks[2], xs[2])])
    got = await store.abatch_get(ks)
    assert all(torch.equal(g, x) for g, x in zip(got, xs, strict=True))
    assert await store.abatch_exists(ks) == [True, True, True]
    assert await store.alookup_prefix(ks) == 3
    assert await store.adelete(ks[1]) is True and await store.alookup_prefix(ks) == 1
    assert (await store.astats())["tiers"][0]["keys"] == 2
    with pytest.raises(InvalidKey):
        await store.aget("nope")
    blob = bytearray(encode_blob(xs[0]))
    blob[60] ^= 4
    with pytest.raises(CorruptBlob):
        await store.backend.aput_blob(ks[0], bytes(blob))
    await store.aclose()
