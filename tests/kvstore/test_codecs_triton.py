"""The Triton kernels agree with the numba CPU path: under TRITON_INTERPRET=1 on CPU tensors (small
shapes, the interpreter runs at a few MB/s), and compiled on CUDA when a GPU is present."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from kvstore.blob import decode_blob, encode_blob
from kvstore.codecs import get_codec
from kvstore.codecs.int4 import Int4Layout, layout_for
from tests.triton_interpret import interpreted_errors, report

CASES = [  # (name, shape, dtype, codec, options)
    ("fp8-token-f16", (2, 2, 64, 2, 64), torch.float16, "fp8", {}),
    ("fp8-tensor-gqa-d128-bf16", (2, 1, 24, 4, 128), torch.bfloat16, "fp8", {"fp8_scale": "tensor"}),
    ("int4-default-f16", (2, 2, 64, 2, 64), torch.float16, "int4", {}),
    ("int4-partial-g32-f32", (2, 1, 40, 3, 64), torch.float32, "int4", {"group_size": 32}),
    ("int4-one-token-bf16", (2, 2, 1, 3, 64), torch.bfloat16, "int4", {}),
    (
        "int4-rotate-gqa-d128-bf16",
        (2, 1, 24, 4, 128),
        torch.bfloat16,
        "int4",
        {"keys": "token", "rotate": True},
    ),
]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return interpreted_errors("tests.kvstore.test_codecs_triton")


def _kv(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    kv = torch.randn(shape, generator=g)
    kv[0, ..., 1] *= 10  # an outlier key channel
    return kv.to(dtype).to(device)


def _triton_payload(tk, kv: torch.Tensor, codec: str, options: dict) -> np.ndarray:
    if codec == "fp8":
        codes, scales = tk.fp8_encode(kv, options.get("fp8_scale", "token"))
        return np.concatenate([codes.cpu().numpy().reshape(-1), scales.cpu().numpy().view(np.uint8)])
    return tk.int4_encode(kv.contiguous(), layout_for(tuple(kv.shape), kv.dtype, **options)).cpu().numpy()


def _triton_decode(tk, payload: np.ndarray, params: dict, shape: tuple, dtype: torch.dtype, device: str):
    if device == "cuda":  # the codec's own device path
        return get_codec("fp8" if "scale" in params else "int4").decode(
            payload, params, shape, dtype, device=device
        )
    if "scale" in params:
        n = int(np.prod(shape))
        codes = torch.from_numpy(payload[:n].copy())
        scales = torch.from_numpy(payload[n:].copy().view(np.float32))
        return tk.fp8_decode(codes, scales, params["scale"], shape, dtype)
    return tk.int4_decode(
        torch.from_numpy(payload.copy()), Int4Layout.from_params(shape, params, dtype), dtype
    )


def _check_case(tk, shape, dtype, codec, options, device: str) -> None:
    kv = _kv(shape, dtype)
    cpu_payload, params = get_codec(codec).encode(kv, **options)
    cpu = np.frombuffer(cpu_payload, np.uint8)
    tri = _triton_payload(tk, kv.to(device), codec, options)
    assert tri.shape == cpu.shape
    if options.get("rotate"):
        # the rotation sums in another order (matmul vs butterflies): codes may move by one step
        lay = layout_for(shape, dtype, **options)
        n = lay.sections()[0][2]
        nbytes = int(np.prod(n))
        lo = lambda b: (b & 15).astype(np.int16)  # noqa: E731
        hi = lambda b: (b >> 4).astype(np.int16)  # noqa: E731
        assert np.abs(lo(tri[:nbytes]) - lo(cpu[:nbytes])).max() <= 1
        assert np.abs(hi(tri[:nbytes]) - hi(cpu[:nbytes])).max() <= 1
        assert (tri[:nbytes] != cpu[:nbytes]).mean() < 0.01
    else:
        assert np.array_equal(tri, cpu), f"{(tri != cpu).sum()} payload bytes differ"
    ref = get_codec(codec).decode(cpu_payload, params, shape, dtype)
    out = _triton_decode(tk, cpu, params, shape, dtype, device).cpu()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if options.get("rotate"):
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize(("name", "shape", "dtype", "codec", "options"), CASES, ids=[c[0] for c in CASES])
def test_triton_matches_cpu_path_interpreted(interpreted, name, shape, dtype, codec, options) -> None:
    assert name in interpreted, f"the subprocess did not report {name}"
    assert interpreted[name] == "", interpreted[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "shape", "dtype", "codec", "options"), CASES, ids=[c[0] for c in CASES])
def test_triton_matches_cpu_path_on_cuda(name, shape, dtype, codec, options) -> None:
    tk = importlib.import_module("kvstore.codecs.triton_kernels")
    _check_case(tk, shape, dtype, codec, options, "cuda")
    # a blob encoded from a CUDA tensor decodes on the CPU like one encoded from the CPU tensor
    kv = _kv(shape, dtype)
    assert torch.equal(decode_blob(encode_blob(kv.cuda(), codec=codec, **options)).cpu(),
                       decode_blob(encode_blob(kv, codec=codec, **options))) or options.get("rotate")  # fmt: skip


if __name__ == "__main__":
    _tk = importlib.import_module("kvstore.codecs.triton_kernels")
    report({c[0]: (lambda c=c: _check_case(_tk, *c[1:], "cpu")) for c in CASES})
