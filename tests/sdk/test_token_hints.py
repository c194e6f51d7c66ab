"""`Store.put(..., token_ids=, parent=)` and `batch_put(..., token_ids=, parents=)`: hints for a server's
KV events (kvstore.token_hints) on every transport and in-process; a hint that does not fit its chunk
is an InvalidArgument and nothing is stored; a good one changes nothing a get returns."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvstore.sdk import Store
from kvstore.sdk import remote as remote_mod

from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument, InvalidKey
from tests.server.conftest import key

TRANSPORTS = ["shm", "tcp", "http", "local"]


def kv(seed: int, tokens: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, tokens, 2, 8, generator=g).half()


def ids(seed: int, n: int = 16) -> list[int]:
    return [seed * 100 + i for i in range(n)]


@pytest.fixture(params=TRANSPORTS)
def store(request, server):
    if request.param == "local":
        s = Store.local(config=StoreConfig(tiers=["cpu"], cpu_capacity="64MiB"))
    else:
        s = Store.connect(server.url, transport=request.param)
    with s:
        yield s


def test_hints_change_nothing_stored(store) -> None:
    assert store.put(key(1), kv(1), token_ids=ids(1)) == ["cpu"]
    assert store.put(key(2), kv(2), token_ids=np.array(ids(2), dtype=np.int64), parent=key(1)) == ["cpu"]
    got = store.batch_put(
        [(key(3), kv(3)), (key(4), kv(4))], token_ids=[ids(3), None], parents=[key(2), None]
    )
    assert got == [["cpu"], ["cpu"]]
    for i in range(1, 5):
        assert torch.equal(store.get(key(i)), kv(i))


@pytest.mark.parametrize(
    "hint",
    [
        {"token_ids": ids(1, 15)},  # the chunk holds 16
        {"token_ids": [2**31] + ids(1, 15)},
        {"token_ids": [-5] + ids(1, 15)},
        {"token_ids": [0.5] + ids(1, 15)},
        {"parent": key(0)},  # a parent without token ids
        {"token_ids": ids(1), "parent": "not-a-key"},
    ],
)
def test_a_bad_hint_is_a_typed_error_and_stores_nothing(store, hint) -> None:
    with pytest.raises((InvalidArgument, InvalidKey)):  # InvalidKey: a parent that is no key
        store.put(key(1), kv(1), **hint)
    assert not store.exists(key(1))


def test_a_batch_with_one_bad_hint_stores_nothing(store) -> None:
    with pytest.raises(InvalidArgument):
        store.batch_put([(key(1), kv(1)), (key(2), kv(2))], token_ids=[ids(1), ids(2, 3)])
    with pytest.raises(InvalidArgument):
        store.batch_put([(key(1), kv(1)), (key(2), kv(2))], token_ids=[ids(1)])  # one list for two keys
    assert store.batch_exists([key(1), key(2)]) == [False, False]


def test_too_many_token_ids_for_one_request_go_without_hints(server, monkeypatch) -> None:
    """Past MAX_HINT_TOKENS_PER_REQUEST token ids the put goes without its hints (they would not fit
    its meta): here 19 over 18, with a count the server would refuse (3 for a chunk of 16): not sent."""
    monkeypatch.setattr(remote_mod, "MAX_HINT_TOKENS_PER_REQUEST", 18)
    with Store.connect(server.url, transport="tcp") as s:
        got = s.batch_put([(key(1), kv(1)), (key(2), kv(2))], token_ids=[ids(1), ids(2, 3)])
        assert got == [["cpu"], ["cpu"]]
        monkeypatch.setattr(remote_mod, "MAX_HINT_TOKENS_PER_REQUEST", 3)
        with pytest.raises(InvalidArgument):  # within the bound: sent, and refused
            s.batch_put([(key(3), kv(3)), (key(4), kv(4))], token_ids=[None, ids(2, 3)])
