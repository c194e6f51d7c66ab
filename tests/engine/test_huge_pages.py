"""Weights and the KV cache on transparent huge pages (engine/layers/huge_pages.py): exact copies, one
aligned buffer, and really backed by huge pages where the kernel's THP setting allows it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from kvstore.engine.layers import cpu_lib, huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping of this process that holds `addr`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m[1], 16) <= addr < int(m[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_to_huge_pages_copies_exactly_into_one_aligned_buffer() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=g).bfloat16(), torch.randn(1000, 33, generator=g),
        torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g), torch.randn(4096, 640, generator=g).half(),
    ]  # fmt: skip
    out = huge_pages.to_huge_pages(tensors)
    for t, o in zip(tensors, out, strict=True):
        assert o.dtype == t.dtype and o.shape == t.shape and o.is_contiguous() and torch.equal(o, t)
        assert o.data_ptr() % 64 == 0
    assert out[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    storage = {o.untyped_storage().data_ptr() for o in out}
    assert len(storage) == 1  # one buffer: small tensors do not each take a 2 MiB page


def test_zeros_huge_pages_is_zeroed_and_aligned() -> None:
    x = huge_pages.zeros_huge_pages((3, 5, 7), torch.float16)
    assert x.shape == (3, 5, 7) and x.dtype == torch.float16 and not x.any()
    assert x.data_ptr() % huge_pages.HUGE_PAGE == 0


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off on this kernel"
)
def test_the_buffer_is_backed_by_huge_pages() -> None:
    # memory the allocator handed out and took back (touched, 4 KiB pages) must not be what we get
    for _ in range(3):
        torch.ones(20 * huge_pages.HUGE_PAGE, dtype=torch.uint8).sum()
    x = huge_pages.zeros_huge_pages((16 * huge_pages.HUGE_PAGE,), torch.uint8)  # 32 MiB, touched by zero_()
    # at least half of it (the kernel falls back to small pages when it has no free huge ones)
    assert _anon_huge_kib(x.data_ptr()) >= 8 * huge_pages.HUGE_PAGE // 1024


def test_the_engine_places_packed_weights_and_the_kv_cache_on_huge_pages(smollm2_dir: Path) -> None:
    if not cpu_lib.available():
        pytest.skip("no CPU kernels here: bf16 weights stay torch tensors")
    from kvstore.engine import LLM

    llm = LLM(str(smollm2_dir), dtype="bfloat16", num_kv_blocks=64, max_model_len=256)
    try:
        runner = llm.engine.runner
        packed = [m.packed for m in runner.model.modules() if getattr(m, "packed", None) is not None]
        assert len(packed) == 4 * runner.model.config.num_hidden_layers + 1  # + lm_head
        assert len({p.untyped_storage().data_ptr() for p in packed}) == 1
        assert runner.kv_cache.data_ptr() % huge_pages.HUGE_PAGE == 0
    finally:
        llm.shutdown()


def test_a_kv_cache_larger_than_memory_is_an_engine_error(smollm2_dir: Path) -> None:
    from kvstore.engine import LLM
    from kvstore.engine.errors import EngineError

    with pytest.raises(EngineError, match="cannot allocate a KV cache of 1000000000 blocks"):
        LLM(str(smollm2_dir), dtype="bfloat16", num_kv_blocks=10**9, max_model_len=256)
