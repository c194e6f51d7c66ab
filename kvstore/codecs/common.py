"""Helpers the lossy codecs share: tensor checks, option parsing, raw-bit views, payload slicing."""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvstore.errors import CodecError

KIND_F16, KIND_BF16, KIND_F32 = 0, 1, 2  # the dtype codes the CPU kernels take
KINDS = {torch.float16: KIND_F16, torch.bfloat16: KIND_BF16, torch.float32: KIND_F32}
_BITS = {torch.float16: (torch.int16, np.uint16), torch.bfloat16: (torch.int16, np.uint16),
         torch.float32: (torch.int32, np.uint32)}  # fmt: skip


def cpu_kernels(module: str) -> Any:
    """The numba kernels of a codec (`cpu_int4`, `cpu_fp8`), imported on first use: numba is the
    `codecs` extra, which a server that only verifies and moves blobs does not need."""
    try:
        return importlib.import_module(f"kvstore.codecs.{module}")
    except ImportError as e:
        if e.name is None or not e.name.startswith("numba"):
            raise
        raise CodecError(
            f"the {module.removeprefix('cpu_')} codec on CPU needs numba: pip install 'kvstore-llm[codecs]'"
        ) from None


def check_kv(kv: Any, codec: str) -> torch.Tensor:
    """A `[2, L, T, H, D]` float16/bfloat16/float32 tensor, or CodecError."""
    if not isinstance(kv, torch.Tensor):
        raise CodecError(f"{codec}: kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype not in KINDS:
        raise CodecError(f"{codec}: KV dtype must be float16, bfloat16 or float32, got {kv.dtype}")
    if kv.dim() != 5 or kv.shape[0] != 2 or kv.numel() == 0:
        raise CodecError(
            f"{codec}: kv must have shape [2, layers, tokens, kv_heads, head_dim], got {tuple(kv.shape)}"
        )
    return kv.detach()


def check_shape(shape: tuple[int, ...], dtype: torch.dtype, codec: str) -> tuple[int, int, int, int, int]:
    if len(shape) != 5 or shape[0] != 2 or dtype not in KINDS or math.prod(shape) == 0:
        raise CodecError(f"{codec}: cannot decode shape {tuple(shape)} of {dtype}")
    return tuple(int(s) for s in shape)  # type: ignore[return-value]


def take_options(codec: str, options: dict, defaults: dict) -> dict:
    """Merge options over defaults; an unknown option is a CodecError naming the known ones."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise CodecError(f"{codec}: unknown option(s) {unknown}; known: {sorted(defaults)}")
    return {**defaults, **options}


def bits(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU float tensor as a numpy array of its raw bits (uint16 or uint32), no copy."""
    tview, npdt = _BITS[t.dtype]
    return t.view(tview).numpy().view(npdt)


def empty_bits(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A fresh CPU tensor and the numpy bits view the kernels write into."""
    out = torch.empty(shape, dtype=dtype)
    return out, bits(out)


class Cursor:
    """Cuts consecutive typed arrays out of one payload buffer (encode: writable; decode: read-only)."""

    def __init__(self, buf: np.ndarray) -> None:
        assert buf.dtype == np.uint8 and buf.ndim == 1
        self.buf, self.pos = buf, 0

    def take(self, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        if self.pos + n > self.buf.size:
            raise CodecError(f"payload of {self.buf.size} bytes is too short for its shape")
        arr = self.buf[self.pos : self.pos + n].view(dtype).reshape(shape)
        self.pos += n
        # a blob's payload starts wherever its header and params end: a reader realigns the (small)
        # scale arrays; a writer must write where they lie (a copy lost every scale of a section at an
        # odd offset: fp8 of 2 * L * T * H * D codes not a multiple of 4, kivi of an odd code row)
        if arr.ctypes.data % arr.itemsize and not self.buf.flags.writeable:
            arr = arr.copy()
            arr.flags.writeable = False  # numba compiles read-only arrays separately
        return arr

    def finish(self) -> None:
        if self.pos != self.buf.size:
            raise CodecError(f"payload is {self.buf.size} bytes, its shape needs {self.pos}")


Sections = list[tuple[str, type, tuple[int, ...]]]  # a payload layout: (name, dtype, shape) in order


def sections_nbytes(sections: Sections) -> int:
    return sum(math.prod(s) * np.dtype(t).itemsize for _, t, s in sections)


def carve(sections: Sections, buf: np.ndarray) -> dict[str, np.ndarray]:
    """Every section of a payload layout cut out of `buf`, which it must fill exactly."""
    cur = Cursor(buf)
    parts = {name: cur.take(t, s) for name, t, s in sections}
    cur.finish()
    return parts


def payload_array(payload: bytes | bytearray | memoryview) -> np.ndarray:
    """A read-only uint8 view of a payload (always read-only: one numba specialisation for decode)."""
    arr = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
    arr.flags.writeable = False
    return arr


def hadamard(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal (Sylvester) Hadamard matrix of a power-of-two size, float32 (symmetric, its own inverse)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * (1 / math.sqrt(d))).to(device)


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row of float32 `x` (..., d), d a power of two,
    by butterflies: spans 1, 2, ..., d/2, each (a, b) -> (a + b, a - b), then times float32(1/sqrt(d)).
    The order of cpu_bits.fwht and triton_kivi, so the three round alike (a matmul sums otherwise)."""
    shape, d = x.shape, x.shape[-1]
    h = 1
    while h < d:
        y = x.reshape(-1, d // (2 * h), 2, h)
        x = torch.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], 2)
        h *= 2
    return x.reshape(shape).mul_(torch.tensor(1 / math.sqrt(d), dtype=torch.float32))


_POOL: ThreadPoolExecutor | None = None


def codec_threads() -> int:
    """Threads a CPU encode/decode may use: KVSTORE_CODEC_THREADS (default 1; the kernels release the
    GIL, so 2 runs the keys and the values of a chunk side by side)."""
    try:
        return max(1, int(os.environ.get("KVSTORE_CODEC_THREADS", "1")))
    except ValueError:
        return 1


def run_parts(parts: list[Callable[[], None]]) -> None:
    """Run independent kernel calls, on up to codec_threads() threads."""
    global _POOL
    n = min(codec_threads(), len(parts))
    if n <= 1:
        for part in parts:
            part()
        return
    if _POOL is None or _POOL._max_workers < n:
        _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvstore-codec")
    for f in [_POOL.submit(part) for part in parts]:
        f.result()
