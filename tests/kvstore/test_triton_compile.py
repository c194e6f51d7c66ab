"""The codecs' Triton kernels compile for a GPU (sm_90, to a cubin with the ptxas Triton ships) on a
machine without one: the interpreter the other Triton tests run under accepts code the compiler
refuses (two return types under a constexpr branch; a constexpr assigned in a static loop), and no
GPU is lent to check it there. One case per kernel and variant the codecs launch."""

from __future__ import annotations

from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no ptxas")

_U8, _I16, _I32, _I64, _F16, _F32 = "*u8", "*i16", "*i32", "*i64", "*fp16", "*fp32"
_KIVI = {"buf_ptr": _U8, "pow_ptr": _F32, "SCALE": "fp32"}


def _variants() -> dict[str, tuple[str, str, dict[str, str], dict]]:
    """name: (module, kernel, pointer and float argument types (the rest int32), constexprs)."""
    out = {}
    for bf16, o in ((True, _I16), (False, _F16)):
        out[f"fp8_decode-bf16={bf16}"] = ("triton_kernels", "_fp8_decode",
            {"codes_ptr": _U8, "scales_ptr": _F32, "out_ptr": o}, {"PER_ROW": True, "BLOCK_R": 16, "BLOCK_D": 128, "BF16": bf16})  # fmt: skip
        out[f"int4_decode_rows-bf16={bf16}"] = ("triton_kernels", "_int4_decode_rows",
            {"codes_ptr": _U8, "sz_ptr": _I16, "h_ptr": _F32, "out_ptr": o}, {"D": 128, "G": 32, "NG": 4, "ROTATE": bf16, "BLOCK_R": 16, "BF16": bf16})  # fmt: skip
        out[f"int4_decode_channels-bf16={bf16}"] = ("triton_kernels", "_int4_decode_channels",
            {"codes_ptr": _U8, "sz_ptr": _I16, "out_ptr": o}, {"G": 32, "BLOCK_C": 64, "BF16": bf16})  # fmt: skip
    out["fp8_encode"] = ("triton_kernels", "_fp8_encode", {"x_ptr": _F16, "codes_ptr": _U8, "scales_ptr": _F32},
                         {"PER_ROW": True, "BLOCK_R": 16, "BLOCK_D": 128})  # fmt: skip
    out["int4_encode_rows"] = ("triton_kernels", "_int4_encode_rows",
        {"x_ptr": _F16, "h_ptr": _F32, "codes_ptr": _U8, "sz_ptr": _I16}, {"D": 128, "G": 32, "NG": 4, "ROTATE": True, "BLOCK_R": 16})  # fmt: skip
    out["int4_encode_channels"] = ("triton_kernels", "_int4_encode_channels",
        {"x_ptr": _F16, "codes_ptr": _U8, "sz_ptr": _I16}, {"G": 32, "BLOCK_C": 64})  # fmt: skip
    for bits in (2, 4, 8):
        out[f"rans-{bits}bit"] = ("triton_ans", "_decode_segments",
            {"src_ptr": _U8, "out_ptr": _U8, "info_ptr": _I64, "lanes_ptr": _I64, "lut_ptr": _I32, "err_ptr": _I32},
            {"BITS": bits, "PER": 8 // bits, "BLOCK": 256})  # fmt: skip
    for bits, meta8, rotate, d, o in ((4, True, True, 64, _I16), (2, False, True, 128, _I16), (4, False, False, 8, _F16),
                                      (2, True, False, 64, _F32)):  # fmt: skip
        consts = {"BITS": bits, "META8": meta8, "ROTATE": rotate, "BLOCK_R": 16, "BLOCK_D": d,
                  "LOG_D": d.bit_length() - 1, "BF16": o == _I16}  # fmt: skip
        out[f"kivi{bits}-meta8={meta8}-rotate={rotate}-d{d}-{o}"] = ("triton_kivi", "_decode_rows",
                                                                     {**_KIVI, "out_ptr": o}, consts)  # fmt: skip
    return out


VARIANTS = _variants()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_compiles_for_sm90(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib  # noqa: PLC0415

    module, kernel, types, consts = VARIANTS[name]
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # the kernels pass it where it matters
    fn = getattr(importlib.import_module(f"kvstore.codecs.{module}"), kernel)
    if not hasattr(fn, "arg_names"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted functions")
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32)
    )
    assert compiled.asm["cubin"], "no cubin"
