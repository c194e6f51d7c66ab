"""A put that supersedes other keys (`batch_put(items, replaces)`: a longer chunk and the shorter
partials it replaces): one round trip to a kvstore-server on its data plane, the superseded keys
deleted only after every blob is stored, nothing deleted by a put that fails, and a server that
ignores the field still ends with them deleted (the SDK asks again); the same on HTTP and in-process.
Tensors are laid out where they go (`kvstore.blob.PreparedBlob`), bit-exact on every transport."""

from __future__ import annotations

import kvstore.server.dataplane_ops as ops
import pytest
import torch
from kvstore.sdk import Store

from kvstore.blob import encode_blob
from kvstore.errors import CorruptBlob
from tests.connectors.test_lookup_round_trips import requests_served
from tests.server.conftest import key

OLD = [key(i) for i in (1, 2, 3)]
NEW = key(9)


def kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 256, 2, 64, generator=g).half()  # 256 KiB: shared memory takes it


def log_store_calls(monkeypatch, store) -> list[str]:
    """What the server's store was asked, in order: puts and deletes."""
    calls: list[str] = []
    for name in ("put_blob", "batch_put", "delete"):
        real = getattr(store, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(store, name, spy)
    return calls


@pytest.mark.parametrize("transport", ["shm", "tcp", "http"])
def test_a_put_deletes_what_it_replaces_after_storing(server, monkeypatch, transport: str) -> None:
    with Store.connect(server.url, transport=transport) as store:
        store.batch_put([(k, kv(i)) for i, k in enumerate(OLD)])
        assert store.health().transport == transport
        calls = log_store_calls(monkeypatch, server.store)
        before = requests_served(server.url)
        assert store.batch_put([(NEW, kv(9))], replaces=OLD) == [["cpu"]]
        assert requests_served(server.url) - before == (2 if transport == "http" else 1)
        assert calls == ["put_blob", "delete", "delete", "delete"], "deleted once the new one is stored"
        assert store.batch_exists([*OLD, NEW]) == [False, False, False, True]
        assert torch.equal(store.get(NEW), kv(9))
        if transport == "shm":
            assert store.backend.counts["shm"] >= 2


@pytest.mark.parametrize("transport", ["shm", "tcp", "http"])
def test_a_failed_put_deletes_nothing(server, transport: str) -> None:
    with Store.connect(server.url, transport=transport) as store:
        store.batch_put([(k, kv(i)) for i, k in enumerate(OLD)])
        bad = bytearray(encode_blob(kv(9), key=NEW))
        bad[-1] ^= 1
        with pytest.raises(CorruptBlob):
            store.batch_put([(NEW, kv(8)), (key(10), bytes(bad))], replaces=OLD)
        assert store.batch_exists([*OLD, NEW]) == [True, True, True, False]


def test_a_server_that_ignores_replaces_still_ends_without_them(server, monkeypatch) -> None:
    """A server before `x`: the put stores, answers without `x`, and the SDK deletes in one more trip."""
    real_put = ops._put

    def old_put(conn, req, keys):
        req.meta.pop("x", None)
        return real_put(conn, req, keys)

    monkeypatch.setattr(ops, "_put", old_put)
    with Store.connect(server.url, transport="shm") as store:
        store.batch_put([(k, kv(i)) for i, k in enumerate(OLD)])
        calls = log_store_calls(monkeypatch, server.store)
        before = requests_served(server.url)
        store.batch_put([(NEW, kv(9))], replaces=OLD)
        assert requests_served(server.url) - before == 2
        assert calls == ["put_blob", "delete", "delete", "delete"]
        assert store.batch_exists([*OLD, NEW]) == [False, False, False, True]


def test_in_process_the_same(tmp_path) -> None:
    with Store.local(tiers=["cpu"], cpu_capacity="64MiB") as store:
        store.batch_put([(k, kv(i)) for i, k in enumerate(OLD)])
        bad = bytearray(encode_blob(kv(9), key=NEW))
        bad[-1] ^= 1
        with pytest.raises(CorruptBlob):
            store.batch_put([(NEW, bytes(bad))], replaces=OLD)
        assert all(store.batch_exists(OLD))
        store.batch_put([(NEW, kv(9))], replaces=OLD)
        assert store.batch_exists([*OLD, NEW]) == [False, False, False, True]
        assert torch.equal(store.get(NEW), kv(9))
        assert store.batch_delete([NEW, key(11)]) == 1
