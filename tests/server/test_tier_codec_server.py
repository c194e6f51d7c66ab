"""kvstore-server with a codec per tier, and the SDK with an entropy-coded codec, over real HTTP."""

from __future__ import annotations

import torch
from kvstore.sdk import Store

from kvstore.blob import decode_blob, verify_blob
from kvstore.codecs import get_codec
from tests.kvstore.test_codecs import make_kv
from tests.server.conftest import key


def test_the_server_keeps_its_tier_codec_and_the_client_decodes(server_factory) -> None:
    srv = server_factory(store={"tier_codec": "cpu=kivi4+ans"})
    kv = make_kv((2, 2, 256, 2, 64), torch.bfloat16)
    with Store.connect(srv.url, transport="http") as store, Store.connect(srv.url, codec="kivi4") as lossy:
        store.put(key(1), kv)  # sent raw, kept as kivi4+ans
        blob = store.get_blob(key(1))
        assert get_codec(verify_blob(blob, key=key(1)).codec_id).name == "kivi4+ans"
        lossy.put(key(2), kv)  # sent as kivi4: only the lossless stage is added
        assert torch.equal(store.get(key(1)), decode_blob(lossy.get_blob(key(2)), key=key(2)))
        assert len(blob) < kv.numel() * 2 / 4


def test_an_entropy_coded_codec_end_to_end(server) -> None:
    kv = make_kv((2, 3, 256, 3, 64), torch.bfloat16)
    with Store.connect(server.url, codec="kivi2+ans") as store:
        store.put(key(3), kv)
        got = store.get(key(3))
        assert got.dtype == kv.dtype and got.shape == kv.shape
        assert torch.equal(got, decode_blob(store.get_blob(key(3)), key=key(3)))
