"""`fp8`: float8 e4m3fn KV with a float32 scale per token per head (default) or per tensor.

Options (passed as `encode_blob(kv, codec="fp8", fp8_scale="tensor")`):
    fp8_scale: "token" (default) — one scale per token per KV head over head_dim;
               "tensor" — one scale for all keys and one for all values of the chunk.

Payload: e4m3 codes, one byte per element in `[2, L, T, H, D]` order, then the float32 scales
(`[2, L, T, H]` for "token", `[2]` for "tensor"). Size vs fp16: 2D / (D + 4) — 1.88x at head_dim 64,
1.94x at 128 (2.0x per tensor). Scales are float32 so that any float32/bfloat16 KV range works;
scale = amax / 448 (448 is e4m3's largest finite value), an all-zero row has scale 0 and decodes to
zeros. NaN or Inf in the KV raise CodecError (e4m3fn has no Inf, and a NaN would poison a whole row).

Error bound: e4m3 keeps 3 mantissa bits, so |x - x'| <= 2^-4 |x| for |x| / scale >= 2^-6, and
<= 2^-10 * scale below that (the subnormal grid), plus the rounding of the KV dtype on decode.
CPU tensors use the numba kernels (cpu_fp8.py), CUDA tensors the Triton kernels (triton_kernels.py);
both do the same float32 operations and agree bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kvstore.codecs import common
from kvstore.errors import CodecError

DEFAULTS = {"fp8_scale": "token"}
_TABLE: np.ndarray | None = None


def _table() -> np.ndarray:
    global _TABLE
    if _TABLE is None:
        # float32 value of each of the 256 e4m3fn codes (NaN codes decode to NaN), by torch's definition
        _TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    return _TABLE


def _nscales(shape: tuple[int, ...], mode: str) -> int:
    return 2 if mode == "tensor" else shape[0] * shape[1] * shape[2] * shape[3]


def payload_size(shape: tuple[int, ...], mode: str = "token") -> int:
    """Bytes of an fp8 payload for a KV tensor of this shape."""
    return math.prod(shape) + 4 * _nscales(shape, mode)  # python ints: a forged shape cannot wrap


class Fp8Codec:
    name = "fp8"
    codec_id = 1

    def encode(self, kv: torch.Tensor, **options: Any) -> tuple[memoryview, dict]:
        kv = common.check_kv(kv, self.name)
        mode = common.take_options(self.name, options, DEFAULTS)["fp8_scale"]
        if mode not in ("token", "tensor"):
            raise CodecError(f"fp8: fp8_scale must be 'token' or 'tensor', got {mode!r}")
        shape = tuple(kv.shape)
        if kv.is_cuda:
            from kvstore.codecs import triton_kernels  # noqa: PLC0415 (only with CUDA)

            codes, scales = triton_kernels.fp8_encode(kv, mode)
            buf = torch.cat([codes.view(-1), scales.view(torch.uint8)]).cpu().numpy()
        else:
            buf = np.empty(payload_size(shape, mode), np.uint8)
            cur = common.Cursor(buf)
            codes = cur.take(np.uint8, (2, int(np.prod(shape[1:4])), shape[4]))
            scales = cur.take(np.float32, (_nscales(shape, mode),))
            x = common.bits(kv.contiguous()).reshape(2, -1, shape[4])
            kind = common.KINDS[kv.dtype]
            cpu_fp8 = common.cpu_kernels("cpu_fp8")

            def encode_half(half: int) -> None:  # keys, values
                if mode == "tensor":
                    scales[half] = cpu_fp8.amax(x[half], kind) / cpu_fp8.E4M3_MAX
                    part = scales[half : half + 1]
                else:
                    part = scales.reshape(2, -1)[half]
                cpu_fp8.encode_rows(x[half], kind, mode == "token", part, codes[half])

            common.run_parts([lambda: encode_half(0), lambda: encode_half(1)])
            scales = torch.from_numpy(scales)
        if not bool(torch.isfinite(scales).all()):
            raise CodecError("fp8: KV contains NaN or Inf")
        return memoryview(buf), {"scale": mode}

    def payload_nbytes(self, params: dict, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        shape = common.check_shape(shape, dtype, self.name)
        if set(params) != {"scale"} or params["scale"] not in ("token", "tensor"):
            raise CodecError(f"fp8: bad params {params!r:.80}")
        return payload_size(shape, params["scale"])

    def decode(
        self,
        payload: bytes | bytearray | memoryview,
        params: dict,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Decode to a CPU tensor, or with `device="cuda"` on the GPU through the Triton kernel."""
        shape = common.check_shape(shape, dtype, self.name)
        mode = params.get("scale")
        if len(payload) != self.payload_nbytes(params, shape, dtype):
            raise CodecError(
                f"fp8: payload is {len(payload)} bytes, shape {shape} needs {payload_size(shape, mode)}"
            )
        cur = common.Cursor(common.payload_array(payload))
        codes = cur.take(np.uint8, (2, int(np.prod(shape[1:4])), shape[4]))
        scales = cur.take(np.float32, (_nscales(shape, mode),))
        cur.finish()
        if device is not None and torch.device(device).type == "cuda":
            from kvstore.codecs import triton_kernels  # noqa: PLC0415

            return triton_kernels.fp8_decode(
                torch.from_numpy(codes.copy()).to(device), torch.from_numpy(scales.copy()).to(device),
                mode, shape, dtype,
            )  # fmt: skip
        out, obits = common.empty_bits(shape, dtype)
        obits = obits.reshape(2, -1, shape[4])
        per_row = mode == "token"
        sc = scales.reshape(2, -1)
        table, kind = _table(), common.KINDS[dtype]
        cpu_fp8 = common.cpu_kernels("cpu_fp8")
        common.run_parts(
            [
                lambda h=h: cpu_fp8.decode_rows(codes[h], sc[h], per_row, table, kind, obits[h])
                for h in range(2)
            ]
        )
        return out
