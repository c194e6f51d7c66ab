"""The Triton kivi decode (triton_kivi.py) against the CPU decode (kivi.py): under TRITON_INTERPRET=1
on CPU tensors (small shapes), and compiled on CUDA when a GPU is present (`-m gpu`). Like
test_triton_ans.py, the interpreted cases run in one subprocess that prints one JSON line per case.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kvstore.codecs import get_codec
from kvstore.codecs.kivi import KiviLayout
from tests.kvstore.test_codecs import make_kv
from tests.triton_interpret import interpreted_errors, report

pytest.importorskip("triton")

CASES = {  # name: (codec, shape, dtype, options)
    "kivi4-default-bf16": ("kivi4", (2, 2, 40, 2, 64), torch.bfloat16, {"key_tokens": 16}),
    "kivi2-default-f16": ("kivi2", (2, 1, 37, 3, 64), torch.float16, {}),
    "kivi4-fp16-values-8bit-keys-f32": (
        "kivi4",
        (2, 1, 24, 2, 64),
        torch.float32,
        {"value_meta": "fp16", "key_meta": "8bit", "key_tokens": 7},
    ),  # fmt: skip
    "kivi2-row-groups-3-sinks-bf16": (
        "kivi2",
        (2, 1, 20, 2, 32),
        torch.bfloat16,
        {"value_group": "row", "sink_tokens": 3},
    ),  # fmt: skip
    "kivi4-d128-gqa-bf16": ("kivi4", (2, 1, 18, 2, 128), torch.bfloat16, {}),
    "kivi4-d6-odd-rows-f16": ("kivi4", (2, 1, 17, 1, 6), torch.float16, {"key_tokens": 5, "sink_tokens": 0}),
    "kivi2-one-token-bf16": ("kivi2", (2, 2, 1, 1, 64), torch.bfloat16, {}),
    "kivi4+ans-bf16": ("kivi4+ans", (2, 1, 32, 1, 64), torch.bfloat16, {}),
    "kivi2+ans-bf16": ("kivi2+ans", (2, 1, 32, 1, 64), torch.bfloat16, {}),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def check(codec: str, shape: tuple, dtype: torch.dtype, options: dict, device: str) -> None:
    c = get_codec(codec)
    payload, params = c.encode(make_kv(shape, dtype, seed=sum(shape)), **options)
    ref = c.decode(payload, params, shape, dtype)
    if codec.endswith("+ans"):
        out = c.decode_device(payload, params, shape, dtype, device)
        params = {k: v for k, v in params.items() if k != "ans"}
    else:
        tk = importlib.import_module("kvstore.codecs.triton_kivi")
        lay = KiviLayout.from_params(shape, params, dtype, c.bits)
        out = tk.kivi_decode(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device), lay, dtype)
    out = out.cpu()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.equal(_bits(out[0]), _bits(ref[0])), "keys (and sinks) differ"
    # values rotated back too: the CPU paths' butterflies are the kernel's (common.hadamard_rows)
    assert torch.equal(_bits(out[1]), _bits(ref[1])), "values differ"


def test_the_scale_table_is_kivis() -> None:
    from kvstore.codecs import kivi  # noqa: PLC0415

    assert torch.equal(importlib.import_module("kvstore.codecs.triton_kivi").POW, kivi._POW)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return interpreted_errors("tests.kvstore.test_triton_kivi")


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kivi_matches_the_cpu_decode_interpreted(interpreted: dict[str, str], name: str) -> None:
    assert name in interpreted, f"the subprocess did not report {name}"
    assert interpreted[name] == "", interpreted[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_triton_kivi_matches_the_cpu_decode_on_cuda(name: str) -> None:
    check(*CASES[name], "cuda")


if __name__ == "__main__":
    report({name: (lambda case=case: check(*case, "cpu")) for name, case in CASES.items()})
