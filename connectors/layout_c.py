"""The C path of `VllmCpuLayout` (connectors/layout_kernels.c): every layer of a chunk moved in one
call, without the torch path's per-layer and per-run tensor ops, which cost more than the copies on
a 5.9 MB SmolLM2 chunk. Built on first use by kvstore.c_build; without a compiler (or with
`KVSTORE_LAYOUT_KERNEL=0`) the torch path serves. The caller has checked shapes; this checks what the
C code relies on (contiguous CPU tensors of one 2- or 4-byte dtype, block ids inside the cache)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from kvstore.c_build import load_library
from kvstore.errors import InvalidArgument

_SRC = Path(__file__).with_name("layout_kernels.c")
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")  # no -march: the .so may run on another CPU
_COMPILE_S = 1.0  # measured 0.25 s with gcc on a 2-core box; said in the log line of a first build


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_library(
        _SRC, _FLAGS, "KVSTORE_LAYOUT_KERNEL", "vLLM CPU caches are moved with torch", expect_s=_COMPILE_S
    )
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.vllm_cpu_scatter.argtypes, lib.vllm_cpu_scatter.restype = [p, p, p, i, i, i, i, i, i, i, i], None
    lib.vllm_cpu_gather.argtypes, lib.vllm_cpu_gather.restype = [p, p, p, i, i, i, i, i, i], None
    return lib


def _usable(kv_caches: Sequence[torch.Tensor], chunk: torch.Tensor) -> bool:
    first = kv_caches[0]
    return (
        first.device.type == "cpu"
        and chunk.device.type == "cpu"
        and chunk.dtype == first.dtype
        and first.element_size() in (2, 4)
        and chunk.is_contiguous()
        and all(c.is_contiguous() for c in kv_caches)
    )


def _args(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> tuple:
    nb = kv_caches[0].shape[0]
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= nb):
        raise InvalidArgument(f"block ids must lie in 0..{nb - 1}, got {list(block_ids)}")
    ptrs = (ctypes.c_void_p * len(kv_caches))(*(c.data_ptr() for c in kv_caches))
    return ids, ptrs


def scatter(
    kv_caches: Sequence[torch.Tensor], chunk: torch.Tensor, block_ids: Sequence[int], first_block: int
) -> bool:
    """Blocks `first_block...` of `chunk` into cache blocks `block_ids`; False: not done (use torch)."""
    lib = _lib()
    if lib is None or not _usable(kv_caches, chunk):
        return False
    ids, ptrs = _args(kv_caches, block_ids)
    _, h, bs, d2 = kv_caches[0].shape
    lib.vllm_cpu_scatter(chunk.data_ptr(), ptrs, ids.data_ptr(), len(ids), first_block, len(kv_caches),
                         chunk.shape[2], h, d2 // 2, bs, chunk.element_size())  # fmt: skip
    return True


def gather(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], out: torch.Tensor) -> bool:
    """Cache blocks `block_ids` into the chunk `out`; False: not done (use torch)."""
    lib = _lib()
    if lib is None or not _usable(kv_caches, out):
        return False
    ids, ptrs = _args(kv_caches, block_ids)
    _, h, bs, d2 = kv_caches[0].shape
    lib.vllm_cpu_gather(out.data_ptr(), ptrs, ids.data_ptr(), len(ids), len(kv_caches), h, d2 // 2, bs,
                        out.element_size())  # fmt: skip
    return True
