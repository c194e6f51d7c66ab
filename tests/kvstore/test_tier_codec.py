"""A codec per tier (`tier_codec`): blobs re-encoded once where they enter a tier, by the rules of
kvstore.transcode, still bound to their key; real disk and Valkey tiers."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from kvstore.server.cli import build_parser

from kvstore.blob import decode_blob, encode_blob, verify_blob
from kvstore.codecs import get_codec
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.store import TieredStore
from tests.kvstore.test_codecs import make_kv
from tests.valkey import ValkeyProcess

K = f"{7:032x}"


def _codec(blob: bytes | memoryview) -> str:
    return get_codec(verify_blob(blob, key=K).codec_id).name


def test_raw_puts_are_kept_per_tier_and_promoted_back_raw(
    tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    kv = make_kv((2, 2, 256, 2, 64), torch.bfloat16)
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    config = StoreConfig(
        tiers=["cpu", "disk", "redis"],
        disk_path=tmp_path,
        redis_url=valkey_server.url,
        redis_prefix=prefix,
        tier_codec="cpu=raw,disk=kivi4,redis=kivi4+ans",
    )
    with TieredStore(config) as store:
        cpu, disk, redis = store.tiers
        store.put_blob(K, encode_blob(kv, key=K))
        assert [_codec(t.get(K)) for t in store.tiers] == ["raw", "kivi4", "kivi4+ans"]
        lossy = decode_blob(disk.get(K), key=K)
        assert torch.equal(decode_blob(redis.get(K), key=K), lossy)  # the same codes, one lossless stage
        assert len(redis.get(K)) < len(disk.get(K)) < len(cpu.get(K)) / 3.5
        cpu.delete(K), disk.delete(K)
        got = store.get_blob(K)  # from redis, promoted: decoded once into cpu (raw), re-coded into disk
        assert _codec(got) == "kivi4+ans" and _codec(cpu.get(K)) == "raw" and _codec(disk.get(K)) == "kivi4"
        assert torch.equal(decode_blob(cpu.get(K), key=K), lossy)
        assert torch.equal(decode_blob(disk.get(K), key=K), lossy)


def test_lossy_blobs_are_not_quantised_twice_and_fp8_kv_stays_raw(tmp_path: Path) -> None:
    config = StoreConfig(tiers=["cpu", "disk"], disk_path=tmp_path, tier_codec={"disk": "kivi4"})
    kivi2 = encode_blob(make_kv((2, 1, 64, 2, 64)), codec="kivi2", key=K)
    with TieredStore(config) as store:
        store.put_blob(K, kivi2)
        assert store.tiers[1].get(K) == kivi2  # kept: kivi2 -> kivi4 would add error
        fp8 = encode_blob(make_kv((2, 1, 64, 2, 64)).to(torch.float8_e4m3fn), key=K)
        store.put_blob(K, fp8)
        assert store.tiers[1].get(K) == fp8  # an fp8 KV cache is stored raw only


def test_the_ans_stage_alone_is_added_and_removed(tmp_path: Path) -> None:
    kv = make_kv((2, 1, 64, 2, 64))
    blob = encode_blob(kv, codec="fp8", key=K)
    config = StoreConfig(tiers=["cpu", "disk"], disk_path=tmp_path, tier_codec="cpu=fp8,disk=fp8+ans")
    with TieredStore(config) as store:
        store.put_blob(K, blob)
        assert store.tiers[0].get(K) == blob and _codec(store.tiers[1].get(K)) == "fp8+ans"
        store.tiers[0].delete(K)
        assert store.get_blob(K) is not None and store.tiers[0].get(K) == blob  # fp8+ans -> fp8 exactly


@pytest.mark.parametrize(
    "value,tiers",
    [
        ("disk=nope", ["cpu", "disk"]),
        ("redis=raw", ["cpu", "disk"]),
        ("disk", ["cpu", "disk"]),
        ("=raw", ["cpu"]),
    ],
)
def test_bad_tier_codecs_are_config_errors(tmp_path: Path, value: str, tiers: list[str]) -> None:
    with pytest.raises(ConfigError):
        TieredStore(StoreConfig(tiers=tiers, disk_path=tmp_path, tier_codec=value))


def test_the_server_flag() -> None:
    args = build_parser().parse_args(["--tier-codec", "cpu=raw,disk=int4+ans"])
    assert StoreConfig(tier_codec=args.tier_codec).tier_codec == {"cpu": "raw", "disk": "int4+ans"}


def test_the_connector_setting(tmp_path: Path) -> None:
    from kvstore.connectors.config import KVTransferConfig  # noqa: PLC0415

    c = KVTransferConfig(
        local_tiers=["cpu", "disk"], local_disk_path=tmp_path, local_tier_codec="disk=kivi4+ans"
    )
    assert c.local_store_config().tier_codec == {"disk": "kivi4+ans"}
    assert KVTransferConfig(codec="kivi2+ans").codec == "kivi2+ans"
