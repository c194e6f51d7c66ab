"""The gpu tier: a clear startup error without CUDA; on CUDA, the Tier protocol over device memory."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from kvstore.clock import ManualClock
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.tiers import Tier, make_tier
from kvstore.tiers.base import TierWriteError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KiB = 1024


def key(i: int) -> str:
    return f"{i:032x}"


def test_gpu_without_cuda_is_a_config_error_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from kvstore.store import TieredStore
    from kvstore.tiers.gpu import GpuTier

    for build in (
        lambda: GpuTier(2**20),
        lambda: make_tier("gpu", StoreConfig(tiers=["gpu", "cpu"])),
        lambda: TieredStore(StoreConfig(tiers=["gpu", "cpu"])),
    ):
        with pytest.raises(ConfigError) as err:
            build()
        assert "--tiers" in str(err.value) and "tiers: [" in str(err.value) and "CUDA" in str(err.value)


def test_importing_the_gpu_tier_never_imports_cupy() -> None:
    code = "import sys, kvstore.tiers.gpu, kvstore.tiers; assert 'cupy' not in sys.modules"
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )


# ---- on CUDA ---------------------------------------------------------------------------------------


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def gpu(clock: ManualClock):
    from kvstore.tiers.gpu import GpuTier

    t = GpuTier(64 * KiB, staging_bytes=4 * KiB, clock=clock)  # small staging buffers: every copy is chunked
    yield t
    t.close()


@cuda
def test_is_a_tier_from_the_factory() -> None:
    t = make_tier("gpu", StoreConfig(tiers=["gpu"], gpu_capacity="1MiB"))
    assert isinstance(t, Tier) and t.name == "gpu" and t.capacity == 2**20
    t.close()


@cuda
@pytest.mark.parametrize("size", [0, 1, 4 * KiB - 1, 4 * KiB, 4 * KiB + 1, 13 * KiB + 7])
def test_roundtrip_through_chunked_staging(gpu, size: int) -> None:
    blob = os.urandom(size)
    for i, form in enumerate((blob, bytearray(blob), memoryview(blob))):
        assert gpu.put(key(i), form) == []
        got = gpu.get(key(i))
        assert bytes(got) == blob and len(got) == size
        dev = gpu.get_tensor(key(i))
        assert dev.is_cuda and dev.dtype == torch.uint8 and dev.numel() == size
        assert bytes(dev.cpu().numpy()) == blob
    assert gpu.usage() == 3 * size and len(gpu) == 3


@cuda
def test_lru_eviction_and_exact_bytes(gpu) -> None:
    blobs = {key(i): os.urandom(20 * KiB) for i in range(3)}
    for k, b in blobs.items():
        assert gpu.put(k, b) == []
    assert gpu.usage() == 60 * KiB
    gpu.get(key(0))  # now key(1) is least recently used
    assert gpu.put(key(9), os.urandom(20 * KiB)) == [key(1)]
    assert not gpu.contains(key(1)) and gpu.contains(key(0))
    assert gpu.usage() == 60 * KiB and gpu.stats.evictions == 1
    with pytest.raises(TierWriteError) as e:  # larger than the tier: not stored, old one gone
        gpu.put(key(0), os.urandom(65 * KiB))
    assert e.value.failed == {key(0): "too_large"}
    assert gpu.get(key(0)) is None and gpu.usage() == 40 * KiB
    assert sorted(gpu.keys()) == sorted([key(2), key(9)])
    assert gpu.delete(key(2)) and not gpu.delete(key(2)) and gpu.usage() == 20 * KiB


@cuda
def test_ttl_and_batches(gpu, clock: ManualClock) -> None:
    gpu.put_many([(key(1), b"a" * 100), (key(2), b"b" * 200)], ttl_s=10)
    gpu.put(key(3), b"c")
    assert [bytes(b) if b is not None else None for b in gpu.get_many([key(2), key(7), key(3)])] == [
        b"b" * 200,
        None,
        b"c",
    ]
    clock.advance(10)
    assert gpu.get(key(1)) is None and not gpu.contains(key(2))
    assert gpu.stats.expired == 2 and gpu.usage() == 1
    with pytest.raises(InvalidArgument):
        gpu.put(key(4), b"x", ttl_s=0)


@cuda
@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "1"])
def test_bad_ttl_is_a_typed_error_and_changes_nothing(gpu, bad: object) -> None:
    gpu.put(key(0), b"old")
    with pytest.raises(InvalidArgument, match="ttl_s"):
        gpu.put(key(0), b"new", ttl_s=bad)
    with pytest.raises(InvalidArgument, match="ttl_s"):
        gpu.put_many([(key(1), b"y")], ttl_s=bad)
    with pytest.raises(InvalidArgument, match="ttl_s"):
        gpu.put_tensor(key(2), torch.ones(4, dtype=torch.uint8, device="cuda"), ttl_s=bad)
    assert bytes(gpu.get(key(0))) == b"old" and not gpu.contains(key(1)) and not gpu.contains(key(2))
    assert gpu.usage() == 3 and len(gpu) == 1


@cuda
def test_put_tensor_stays_on_device(gpu) -> None:
    src = torch.randint(0, 256, (5000,), dtype=torch.uint8, device="cuda")
    gpu.put_tensor(key(1), src)
    src.zero_()  # the tier holds its own copy
    assert gpu.get_tensor(key(1)).sum().item() > 0
    with pytest.raises(InvalidArgument):
        gpu.put_tensor(key(2), torch.zeros(4, dtype=torch.float16, device="cuda"))


@cuda
def test_concurrent_puts_and_gets(gpu) -> None:
    blobs = {key(i): os.urandom(3 * KiB + i) for i in range(16)}
    errors: list[BaseException] = []

    def worker(ks: list[str]) -> None:
        try:
            for _ in range(5):
                for k in ks:
                    gpu.put(k, blobs[k])
                    got = gpu.get(k)
                    assert got is None or bytes(got) == blobs[k]
        except BaseException as e:  # reported below: a thread cannot fail the test itself
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(list(blobs)[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert gpu.usage() <= gpu.capacity and gpu.usage() == sum(len(blobs[k]) for k in gpu.keys())
