"""Blobs are bound to their key (issue 30, item 5): a valid blob of another key is a miss, never served.

Every tier a third party can write (a disk file replaced, a Valkey key SET by someone else) and every
reader that names its key checks the tag; a blob encoded with no key, and a version-1 blob, make no
claim and stay readable under any key.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from kvstore.sdk import Store

from kvstore.blob import (
    _CHECK,
    _HEAD,
    HEADER_SIZE,
    V1_HEADER_SIZE,
    copy_verified,
    decode_blob,
    encode_blob,
    key_tag,
    verify_blob,
)
from kvstore.config import StoreConfig
from kvstore.errors import CorruptBlob, ForeignBlob
from kvstore.store import TieredStore
from tests.blobs import sealed
from tests.valkey import ValkeyProcess

A, B = f"{1:032x}", f"{2:032x}"  # keys that differ in their last byte only


def _kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 16, 2, 64, generator=g).half()


def _v1(blob: bytes) -> bytes:
    """The same blob in the version-1 layout (no key tag), as an older writer made it."""
    head = list(_HEAD.unpack_from(blob))
    head[1] = 1
    packed, rest = _HEAD.pack(*head), blob[HEADER_SIZE:]
    return sealed(packed, rest)


@pytest.mark.parametrize("codec", ["raw", "fp8", "int4"])
def test_a_bound_blob_verifies_only_for_its_key(codec: str) -> None:
    kv = _kv(0)
    blob = encode_blob(kv, codec=codec, key=A)
    header = verify_blob(blob, key=A)
    assert header.key_tag == key_tag(A) != 0 and verify_blob(blob) == header  # no key: no claim checked
    for check in (
        lambda: verify_blob(blob, key=B),
        lambda: decode_blob(blob, key=B),
        lambda: decode_blob(blob, header=header, key=B),  # a header verified before, read as another key
        lambda: copy_verified(blob, bytearray(len(blob)), key=B),
    ):
        with pytest.raises(ForeignBlob, match="another key"):
            check()
    assert issubclass(ForeignBlob, CorruptBlob)  # every reader already treats it as a miss
    assert decode_blob(blob, key=A).shape == kv.shape
    assert copy_verified(blob, bytearray(len(blob)), key=A) == header


def test_unbound_and_version_1_blobs_stay_readable_under_any_key() -> None:
    kv = _kv(1)
    unbound = encode_blob(kv)
    old = _v1(unbound)
    assert len(old) == len(unbound) - (HEADER_SIZE - V1_HEADER_SIZE) and old[4] == 1
    for blob in (unbound, old):
        assert verify_blob(blob, key=A).key_tag == 0
        assert torch.equal(decode_blob(blob, key=B), kv)
        assert copy_verified(blob, bytearray(len(blob)), key=B).key_tag == 0


def test_the_key_tag_is_covered_by_the_checksum() -> None:
    blob = bytearray(encode_blob(_kv(2), key=A))
    blob[V1_HEADER_SIZE:HEADER_SIZE] = _CHECK.pack(key_tag(B))  # re-tagged without a new checksum
    with pytest.raises(CorruptBlob, match="checksum"):
        verify_blob(bytes(blob), key=B)


def _disk_file(root: Path, key: str) -> Path:
    (path,) = (root / key[:2] / key[2:4]).glob(f"{key}*")
    return path


def test_a_disk_file_replaced_by_another_keys_blob_is_a_miss(tmp_path: Path) -> None:
    config = StoreConfig(tiers=["disk"], disk_path=tmp_path)
    with TieredStore(config) as store:
        store.put_blob(A, encode_blob(_kv(3), key=A))
        store.put_blob(B, encode_blob(_kv(4), key=B))  # the same size: only the key tells them apart
    path_a, foreign = _disk_file(tmp_path, A), _disk_file(tmp_path, B).read_bytes()
    path_a.write_bytes(foreign)
    with TieredStore(config) as store:  # a restart: the index comes from the files
        reasons: list[str | None] = []
        assert store.get_blob(A, reasons) is None and reasons == ["corrupt"]
        assert store.metrics.tier["disk"].corrupt._value.get() == 1
        assert not path_a.exists()  # deleted like a corrupt blob
        assert torch.equal(decode_blob(store.get_blob(B), key=B), _kv(4))


@pytest.mark.parametrize("version", [1, 2])
def test_the_store_binds_an_unbound_blob_so_a_swapped_file_of_it_is_a_miss(
    tmp_path: Path, version: int
) -> None:
    """A raw PUT of a blob encoded with no key (issue 45 item 11): the store keeps it bound to its key."""
    config = StoreConfig(tiers=["disk"], disk_path=tmp_path)
    unbound = {A: encode_blob(_kv(3)), B: encode_blob(_kv(4))}  # the same size: only the key tells them apart
    with TieredStore(config) as store:
        for k, blob in unbound.items():
            store.put_blob(k, blob if version == 2 else _v1(blob))
            kept = store.get_blob(k)
            assert verify_blob(kept, key=k).key_tag == key_tag(k)
            assert torch.equal(decode_blob(kept, key=k), decode_blob(blob))
    _disk_file(tmp_path, A).write_bytes(_disk_file(tmp_path, B).read_bytes())
    with TieredStore(config) as store:
        reasons: list[str | None] = []
        assert store.get_blob(A, reasons) is None and reasons == ["corrupt"]
        assert torch.equal(decode_blob(store.get_blob(B), key=B), _kv(4))


def test_a_put_of_another_keys_blob_is_refused(tmp_path: Path) -> None:
    with TieredStore(StoreConfig(tiers=["cpu"])) as store:
        with pytest.raises(ForeignBlob):
            store.put_blob(A, encode_blob(_kv(5), key=B))
        with pytest.raises(ForeignBlob):
            store.batch_put([(A, encode_blob(_kv(5), key=A)), (B, encode_blob(_kv(5), key=A))])
        assert store.get_blob(A) is None and store.get_blob(B) is None  # nothing of the batch stored


def test_the_sdk_binds_what_it_encodes() -> None:
    with Store.local(tiers=["cpu"]) as store:
        store.put(A, _kv(6))
        store.batch_put([(B, _kv(7))])
        assert verify_blob(store.get_blob(A), key=A).key_tag == key_tag(A)
        assert verify_blob(store.get_blob(B), key=B).key_tag == key_tag(B)
        assert torch.equal(store.get(A), _kv(6))
        with pytest.raises(ForeignBlob):
            store.put(A, store.get_blob(B))


def test_a_valkey_key_set_to_another_keys_blob_is_a_miss(valkey_server: ValkeyProcess) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    config = StoreConfig(tiers=["redis"], redis_url=valkey_server.url, redis_prefix=prefix)
    with TieredStore(config) as store:
        store.put_blob(A, encode_blob(_kv(8), key=A))
        with valkey_server.client() as raw:  # a third party writes B's valid blob under A
            assert raw.set(f"{prefix}{A}", encode_blob(_kv(9), key=B))
            reasons: list[str | None] = []
            assert store.get_blob(A, reasons) is None and reasons == ["corrupt"]
            assert store.metrics.tier["redis"].corrupt._value.get() == 1
            assert not raw.exists(f"{prefix}{A}")  # deleted like a corrupt blob
