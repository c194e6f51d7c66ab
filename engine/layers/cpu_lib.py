"""The engine's CPU kernel library (`cpu_kernels.c`): built with the system C compiler on first use by
the project's one build helper (`kvstore.c_build`, cached under `$KVSTORE_CACHE_DIR/kernels`), loaded
through ctypes, and the conventions every call into it follows (dtype codes, pointers, argument checks).

The kernels need x86-64 with AVX-512F and a C compiler (`$CC`, `cc` or `gcc`); without either, or
with `KVSTORE_CPU_KERNELS=0`, `available()` is False and the layers keep their torch paths.

On CPUs with AMX (`amx_bf16`) the bf16 GEMMs run on the tile units (activations rounded to bf16, as
oneDNN does); without AMX but with `avx512_bf16` (Zen 4/5, Cooper Lake) they run on its dot-product
instruction, the activations rounded the same way. `KVSTORE_AMX=0` turns the tile units off (GEMMs and
attention), `KVSTORE_AVX512_BF16=0` the dot products; with neither, bf16 GEMMs widen the weights to
fp32 FMAs on fp32 activations (the exact kernel). The choice is made once per process, when the
library loads, because it decides how `cpu_ops.pack_weight` lays weights out.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path

import torch

from kvstore.c_build import build_library

logger = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fno-math-errno", "-std=c11")
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}  # cache dtypes
W_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # weight dtypes

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "gemm_w16": [_ptr, _i64, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64],
    "paged_decode_attention": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _int, _i64, _i64, _i64, _ptr, _ptr, _ptr,
                               _i64, _ptr, _ptr, _f32, _i64, _i64, _i64, _i64, _i64, _i64, _i64],
    "store_kv": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _int, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64,
                 _i64],
    "rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _int, _f32, _ptr, _i64, _i64, _i64, _i64],
    "rope": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
    "silu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64],
    "amx_enable": [],
    "bf16_dot_enable": [],
    "gemm_kind": [],
    "gemm_layout": [_int, _i64],
    "attention_on_tiles": [_int, _i64, _i64, _i64, _i64, _i64],
    "decoder_layers": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                      _ptr, _i64],
}  # fmt: skip
_RETURNS_INT = ("amx_enable", "bf16_dot_enable", "gemm_kind", "gemm_layout", "attention_on_tiles")


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo's `flags` line, space-separated)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _supported() -> str | None:
    """Why the kernels cannot run here, or None."""
    if os.environ.get("KVSTORE_CPU_KERNELS", "1") == "0":
        return "KVSTORE_CPU_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    if "avx512f" not in cpu_flags().split():
        return "the CPU has no AVX-512F"
    return None


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The loaded library with its signatures set and its GEMM kind chosen, or None (logged once)."""
    reason = _supported()
    if reason is None:
        try:  # -march=native: the CPU's flags are part of the build's cache key
            loaded = ctypes.CDLL(str(build_library(_SRC, _FLAGS, extra_key=cpu_flags(), libs=("-lm",))))
        except OSError as e:
            reason = f"cannot build them: {e}"
        else:
            for name, args in _SIGNATURES.items():
                fn = getattr(loaded, name)
                fn.argtypes, fn.restype = args, (_int if name in _RETURNS_INT else None)
            flags = cpu_flags().split()
            if os.environ.get("KVSTORE_AMX", "1") != "0" and "amx_bf16" in flags:
                if not loaded.amx_enable():
                    logger.warning("the kernel refused AMX tile state (ARCH_REQ_XCOMP_PERM): AVX-512 GEMMs")
            if (
                not loaded.gemm_kind()
                and os.environ.get("KVSTORE_AVX512_BF16", "1") != "0"
                and "avx512_bf16" in flags
            ):
                loaded.bf16_dot_enable()  # a no-op where the compiler does not target AVX512_BF16
            return loaded
    logger.warning("engine CPU kernels off (%s): torch paths instead", reason)
    return None


def available() -> bool:
    return lib() is not None


def ptr_of(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer, or NULL for None."""
    return None if t is None else t.data_ptr()


def check_rows(t: torch.Tensor) -> None:
    """Activations: fp32 [rows, columns], contiguous in the last dimension."""
    assert t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1, (t.dtype, t.shape, t.stride())


def check_scales(hkv: int, fp8: bool | None, *scales: torch.Tensor | None) -> None:
    """fp8 scales: fp32, contiguous, one per KV head; with `fp8` given, present exactly for an fp8 cache."""
    for s in scales:
        assert fp8 is None or (s is not None) == fp8, "scales go with an fp8 cache, and only with one"
        assert s is None or (s.dtype == torch.float32 and s.is_contiguous() and s.numel() == hkv)
