"""A PUT whose blob is bound to another key is refused (422, JSON, type ForeignBlob) on every path:
HTTP single and batch puts, and the SDK's transports (issue 30, item 5)."""

from __future__ import annotations

import pytest
import torch
from kvstore.sdk import Store

from kvstore.blob import encode_blob
from kvstore.errors import ForeignBlob
from kvstore.protocol import wire
from tests.server.conftest import key


def _bound(k: str, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_blob(torch.randn(2, 2, 16, 2, 8, generator=g).half(), key=k)


def test_http_put_of_another_keys_blob_is_a_422(server) -> None:
    r = server.request("PUT", wire.chunk_path(key(1)), _bound(key(2)))
    assert r.status == 422 and r.json()["type"] == "ForeignBlob" and "another key" in r.json()["error"]
    frame = b"".join(bytes(p) for p in wire.encode_frame([key(3), key(4)], [_bound(key(3)), _bound(key(3))]))
    r = server.request("POST", wire.BATCH_PUT_PATH, frame)
    assert r.status == 422 and r.json()["type"] == "ForeignBlob"
    assert server.usage() == (0, 0)  # nothing of either request stored
    assert server.request("PUT", wire.chunk_path(key(1)), _bound(key(1))).status == 201
    assert server.request("GET", wire.chunk_path(key(1))).body == _bound(key(1))


@pytest.mark.parametrize("transport", ["http", "tcp", "shm"])
def test_sdk_put_of_another_keys_blob_raises_foreign_blob(server, transport: str) -> None:
    with Store.connect(server.url, transport=transport) as store:
        with pytest.raises(ForeignBlob):
            store.put(key(1), _bound(key(2)))
        with pytest.raises(ForeignBlob):
            store.batch_put([(key(1), _bound(key(1))), (key(2), _bound(key(1)))])
        assert store.get(key(1)) is None
        store.put(key(1), _bound(key(1)))
        assert store.get_blob(key(1)) == _bound(key(1))
