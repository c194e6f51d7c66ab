"""The kivi4 / kivi2 decode in C (kivi_kernels.c, built on first use by kvstore.c_build): the
torch decode in kivi.py, bit for bit, at several GB/s on one core (bench_codec_quality.py). Without
a C compiler, or with KVSTORE_KIVI_KERNEL=0, kivi.py decodes with torch. A head of 64 values is
rotated back in AVX2 registers where the CPU has them (KVSTORE_KIVI_SIMD=0: SSE2, the same bits)."""

from __future__ import annotations

import ctypes
import functools
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.c_build import load_library
from kvstore.codecs import common

_SRC = Path(__file__).with_name("kivi_kernels.c")
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off")  # no -march: the .so may move


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_library(_SRC, _FLAGS, "KVSTORE_KIVI_KERNEL", "torch decodes kivi (several times slower)")
    if lib is None:
        return None
    p, i64, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.kivi_decode_keys.argtypes = [p, i64, i64, i64, i, i64, i, p, p, p, i, p, i64]
    lib.kivi_decode_values.argtypes = [p, i64, i64, i64, i, i64, i64, i, f, i, p, p, p, i, p]
    lib.kivi_decode_keys.restype = lib.kivi_decode_values.restype = lib.kivi_simd.restype = i
    lib.kivi_simd.argtypes = [i]
    lib.kivi_simd(int(os.environ.get("KVSTORE_KIVI_SIMD", "1") != "0"))
    return lib


def kernel_available() -> bool:
    return _lib() is not None


def decode(parts: dict[str, np.ndarray], lay: Any, kind: int, ob: np.ndarray, pow_table: np.ndarray) -> bool:
    """A kivi payload's sections (kivi.KiviLayout.carve) -> ob, the KV's bits as a C-contiguous
    (2, L, T, C); the sink keys are the caller's. `pow_table`: kivi's 8bit scale grid (float32 [256]).
    False (nothing written) without the kernel."""
    lib = _lib()
    if lib is None:
        return False
    assert ob.flags.c_contiguous and ob.shape == (2, lay.shape[1], lay.shape[2], lay.channels)
    assert pow_table.dtype == np.float32 and pow_table.shape == (256,) and pow_table.flags.c_contiguous
    _, nl, nt, _, d = lay.shape
    c, bits = lay.channels, lay.bits
    ptr = {n: a.ctypes.data for n, a in parts.items()}
    k8, v8 = lay.key_meta == "8bit", lay.value_meta == "8bit"
    layer_bytes = nt * c * ob.itemsize

    def keys() -> None:
        meta, ref = (ptr["k_meta"], ptr["k_ref"]) if k8 else (ptr["k_sz"], None)
        out = ob[0].ctypes.data + lay.sink * c * ob.itemsize
        err = lib.kivi_decode_keys(
            ptr["k_codes"], nl, nt - lay.sink, c, bits, lay.key_tokens, k8, meta, ref, pow_table.ctypes.data, kind,
            out, layer_bytes,
        )  # fmt: skip
        if err:
            raise MemoryError("kivi: the key decode's buffers")

    def values() -> None:
        meta, ref = (ptr["v_meta"], ptr["v_ref"]) if v8 else (ptr["v_sz"], None)
        err = lib.kivi_decode_values(
            ptr["v_codes"], nl, nt, c, bits, lay.value_group, d, lay.rotate_values, 1 / math.sqrt(d), v8,
            meta, ref, pow_table.ctypes.data, kind, ob[1].ctypes.data,
        )  # fmt: skip
        if err:
            raise MemoryError("kivi: the value decode's buffers")

    common.run_parts([keys, values] if nt > lay.sink else [values])
    return True
