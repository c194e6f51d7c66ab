"""kivi4 / kivi2: error bounds per group, sizes, edge cases (all-equal groups, odd lengths, the last
partial key group, tiny chunks, sections at odd offsets), bad input and forged params; the C decode
against the torch decode, bit for bit."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvstore.blob import decode_blob, encode_blob, verify_blob
from kvstore.codecs import cpu_kivi, get_codec, kivi
from kvstore.codecs.common import bits, hadamard, hadamard_rows, payload_array
from kvstore.codecs.kivi import KiviLayout, layout_for
from kvstore.errors import CodecError, CorruptBlob
from tests.kvstore.test_blob import forge
from tests.kvstore.test_codecs import EPS, make_kv

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
CODECS = {"kivi4": 4, "kivi2": 2}


def _bound(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """scale/2 per element, + the fp16 rounding of scale (times the top code) and of zero."""
    top = (1 << bits) - 1
    mn, mx = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    return (mx - mn) / top * (0.5 + top * 2.0**-10) + mn.abs() * 2.0**-10


def _s0_8bit(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """An 8bit group's scale before its log grid: <= top / (top - 1) x (max - min) / top (an integer
    zero point), or max |x| / top for a group away from 0."""
    top = (1 << bits) - 1
    s0 = (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / top * top / (top - 1) * 1.001
    return torch.maximum(s0, x.abs().amax(dim, keepdim=True) / top * 1.001)


def check_bound(kv: torch.Tensor, out: torch.Tensor, codec: str, **opts: object) -> None:
    bits = CODECS[codec]
    lay = layout_for(tuple(kv.shape), kv.dtype, bits, **opts)
    _, nl, nt, nh, d = kv.shape
    x, y = kv.double().reshape(2, nl, nt, nh * d), out.double().reshape(2, nl, nt, nh * d)
    eps = EPS[kv.dtype]
    assert torch.equal(out[0, :, : lay.sink], kv[0, :, : lay.sink])  # sink keys exact
    keys = x[0, :, lay.sink :]
    groups = [keys[:, a : a + lay.key_tokens] for a in range(0, keys.shape[1], lay.key_tokens)]
    if lay.key_meta == "8bit":  # as 8bit values (below), per channel: the grid's top is the channel's
        s0s = [_s0_8bit(g, 1, bits) for g in groups]
        top_s0 = torch.stack(s0s).amax(0)
    for i, g in enumerate(groups):
        a = i * lay.key_tokens
        err = (g - y[0, :, lay.sink + a : lay.sink + a + lay.key_tokens]).abs()
        if lay.key_meta == "fp16":
            assert bool((err <= _bound(g, 1, bits) + g.abs() * eps + 1e-6).all())
        else:
            s = torch.maximum(s0s[i] * 2 ** (1 / 16), top_s0 * 2**-15)
            assert bool((err <= s / 2 + g.abs() * eps + 1e-6).all())
    xv, yv = x[1], y[1]
    if lay.rotate_values:  # the bound holds in the rotated basis
        h = hadamard(d).double()
        xv, yv = ((t.reshape(nl, nt, nh, d) @ h).reshape(nl, nt, nh * d) for t in (xv, yv))
    v = xv.reshape(nl, nt, -1, lay.value_group)
    err = (v - yv.reshape(v.shape)).abs()
    if lay.value_meta == "fp16":
        assert bool((err <= _bound(v, 3, bits) + v.abs() * eps + 1e-6).all())
    else:  # scale <= top / (top - 1) x (max - min) / top (an integer zero point), on a grid of
        # 2^(1/16) steps under the layer's largest
        s0 = _s0_8bit(v, 3, bits)
        s = torch.maximum(s0 * 2 ** (1 / 16), s0.amax(1, keepdim=True) * 2**-15)
        slack = (x[1].abs().amax() * eps * d**0.5) if lay.rotate_values else v.abs() * eps  # dtype rounding
        assert bool((err <= s / 2 + slack + 1e-6).all())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,opts",
    [
        ((2, 2, 256, 3, 64), {}),
        ((2, 2, 300, 3, 64), {}),  # a last key group of 43 tokens after the 256 (and the sink)
        ((2, 1, 17, 2, 8), {"key_tokens": 5}),  # odd length, groups of 5, 1, sink
        ((2, 3, 1, 1, 4), {}),  # one token: no sink, one-token key groups
        ((2, 2, 15, 3, 64), {"value_group": 64}),  # under 16 tokens: no sink
        ((2, 1, 64, 2, 64), {"sink_tokens": 0, "value_group": 8}),
        ((2, 2, 256, 3, 64), {"value_group": 64, "value_meta": "8bit"}),
        ((2, 2, 37, 2, 16), {"value_meta": "8bit", "key_tokens": 16}),
        ((2, 1, 1, 1, 8), {"value_meta": "8bit"}),
        ((2, 2, 64, 3, 64), {"value_group": "row"}),  # every head's values in one group: no rotation
        ((2, 1, 32, 2, 48), {}),  # head_dim 48: no rotation
        ((2, 1, 32, 2, 64), {"value_meta": "fp16", "rotate_values": True}),
        ((2, 2, 256, 3, 64), {"key_meta": "8bit", "key_tokens": 128}),
        ((2, 2, 300, 3, 64), {"key_meta": "8bit", "key_tokens": 64}),  # a last key group of 43 (padded)
        ((2, 1, 17, 2, 8), {"key_meta": "8bit", "key_tokens": 5}),
        ((2, 3, 1, 1, 4), {"key_meta": "8bit"}),  # one token: one key group of 1
    ],
)
def test_round_trip_within_the_bound(codec: str, dtype: torch.dtype, shape: tuple, opts: dict) -> None:
    kv = make_kv(shape, dtype, seed=sum(shape))
    blob = encode_blob(kv, codec=codec, **opts)
    out = decode_blob(blob)
    assert out.shape == kv.shape and out.dtype == dtype
    check_bound(kv, out, codec, **opts)
    assert verify_blob(blob).payload_len == layout_for(shape, dtype, CODECS[codec], **opts).nbytes()


@pytest.mark.parametrize("codec", CODECS)
def test_all_equal_groups_decode_exactly(codec: str) -> None:
    kv = make_kv((2, 2, 64, 2, 16))
    kv[0, :, :, 1, 3] = 0.75  # one key channel constant over every token
    kv[1, 1] = -2.5  # a layer of constant values
    kv[:, 0, 5] = 0  # a token of zeros (its values' group)
    fp16 = {"value_meta": "fp16", "key_meta": "fp16"}
    out = decode_blob(encode_blob(kv, codec=codec, rotate_values=False, **fp16))
    assert torch.equal(out[0, :, :, 1, 3], kv[0, :, :, 1, 3])
    assert torch.equal(out[1, 1], kv[1, 1]) and torch.equal(out[1, 0, 5], kv[1, 0, 5])
    eight = decode_blob(encode_blob(kv, codec=codec, rotate_values=False, key_meta="fp16"))  # 8bit V
    assert torch.equal(eight[1, 0, 5], kv[1, 0, 5]) and torch.equal(eight[0, :, :, 1, 3], kv[0, :, :, 1, 3])
    assert bool(((eight[1, 1].float() + 2.5).abs() <= 2.5 * 2 ** (1 / 16) - 2.5 + 1e-3).all())
    rotated = decode_blob(encode_blob(kv, codec=codec))  # the defaults: within 5% too
    assert bool(((rotated[1, 1].float() + 2.5).abs() <= 0.125).all())
    keys8 = decode_blob(encode_blob(kv, codec=codec, key_meta="8bit"))  # a key scale on a grid: an fp16 step
    assert bool(((keys8[0, 1, :, 1, 3].float() - 0.75).abs() <= 0.75 * 2**-10).all())  # layer 0: token 5 is 0


@pytest.mark.parametrize(
    "codec,floor", [("kivi4", 3.77), ("kivi2", 6.65), ("kivi4+ans", 4.0), ("kivi2+ans", 6.7)]
)
def test_size_vs_bf16_with_the_header(codec: str, floor: float) -> None:
    kv = make_kv((2, 30, 256, 3, 64), torch.bfloat16)  # a SmolLM2-135M chunk
    blob = encode_blob(kv, codec=codec)
    assert kv.numel() * 2 / len(blob) >= floor


@pytest.mark.parametrize("codec", ["kivi4", "kivi4+ans"])
def test_kivi4_default_is_128_token_key_groups_with_8bit_key_metadata(codec: str) -> None:
    kv = make_kv((2, 2, 256, 3, 64), torch.bfloat16)
    params = verify_blob(encode_blob(kv, codec=codec)).params
    assert params["kt"] == 128 and params["km"] == 1  # bench_codec_quality: KL 0.0085 -> 0.0074
    assert "km" not in verify_blob(encode_blob(kv, codec="kivi2")).params  # kivi2 keeps fp16 key metadata


def test_a_blob_of_the_earlier_kivi4_default_is_written_and_read_as_before() -> None:
    """kivi4's default was 256-token key groups with fp16 metadata (until the 8-bit ones): the same
    options still write the same bytes (digest taken then), and those decode to the same bits (digest
    taken when the decode's rotation became butterflies instead of a matmul: the values moved by at
    most one rounding step of the dtype, tests/kvstore/test_triton_kivi.py's old bound)."""
    g = torch.Generator().manual_seed(34)
    kv = (torch.randn(2, 2, 300, 3, 64, generator=g) * 2).to(torch.bfloat16)
    blob = encode_blob(kv, codec="kivi4", key_tokens=256, key_meta="fp16")
    assert verify_blob(blob).params == {"kt": 256, "vg": 64, "sink": 1, "vm": 1, "rv": 1}
    assert hashlib.sha256(blob).hexdigest()[:16] == "0c2b44e7cca33b98"
    out = decode_blob(blob).view(torch.int16).numpy().tobytes()
    assert hashlib.sha256(out).hexdigest()[:16] == "141edfd315890046"


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e7])
@pytest.mark.parametrize("at", [(1, 1, 17, 1, 5), (0, 1, 9, 0, 2), (0, 0, 0, 1, 7)])  # value, key, sink key
def test_non_finite_or_out_of_fp16_range_kv_is_rejected(codec: str, bad: float, at: tuple) -> None:
    kv = make_kv((2, 2, 32, 2, 8), torch.float32)
    kv[at] = bad
    if at[2] == 0 and abs(bad) < float("inf") and bad == bad:
        return  # a big but finite sink key is stored exactly: fine
    with pytest.raises(CodecError, match="NaN|Inf|float16 range"):
        encode_blob(kv, codec=codec)


@pytest.mark.parametrize(
    "opts",
    [
        {"key_tokens": 0},
        {"value_group": 7},
        {"value_group": 0},
        {"sink_tokens": 65},
        {"key_tokens": 1.5},
        {"group_size": 64},
        {"value_meta": "int8"},
        {"key_meta": "int8"},
        {"rotate_values": 1},
        {"rotate_values": True, "value_group": "row"},
    ],
)
def test_bad_options_are_codec_errors(opts: dict) -> None:
    with pytest.raises(CodecError):
        encode_blob(make_kv((2, 1, 64, 2, 8)), codec="kivi4", **opts)


def test_a_row_that_does_not_pack_is_refused() -> None:
    with pytest.raises(CodecError, match="pack"):
        encode_blob(torch.ones(2, 1, 4, 1, 2), codec="kivi2")  # 2 channels of 2 bits: not a byte


@pytest.mark.parametrize("codec", CODECS)
def test_forged_params_are_corrupt(codec: str) -> None:
    good = encode_blob(make_kv((2, 2, 64, 2, 16)), codec=codec)
    h = verify_blob(good)
    payload = good[h.payload_offset :]
    for params in ({**h.params, "kt": 32}, {**h.params, "vg": 3}, {"kt": 256}, {**h.params, "sink": "1"}):
        with pytest.raises(CorruptBlob):
            verify_blob(forge(good, payload, params=params))
    with pytest.raises(CodecError):
        get_codec(codec).decode(memoryview(payload)[:-1], h.params, h.shape, h.dtype)


# the C decode (kivi_kernels.c) against the torch decode: every layout the format has
KERNEL_CASES = {  # name: (codec, shape, dtype, options)
    "kivi4-default-bf16": ("kivi4", (2, 3, 256, 3, 64), torch.bfloat16, {}),
    "kivi2-default-f16": ("kivi2", (2, 2, 300, 3, 64), torch.float16, {}),
    "kivi4-f32-fp16-values-key-groups-of-7": (
        "kivi4",
        (2, 1, 24, 2, 64),
        torch.float32,
        {"value_meta": "fp16", "key_meta": "8bit", "key_tokens": 7},
    ),  # fmt: skip
    "kivi2-row-groups-3-sinks": (
        "kivi2",
        (2, 1, 20, 2, 32),
        torch.bfloat16,
        {"value_group": "row", "sink_tokens": 3},
    ),
    "kivi4-d128": ("kivi4", (2, 1, 18, 2, 128), torch.bfloat16, {}),
    "kivi4-d256-fp16-keys": (
        "kivi4",
        (2, 1, 40, 1, 256),
        torch.float16,
        {"key_meta": "fp16", "key_tokens": 16},
    ),
    "kivi4-d16-groups-of-4": ("kivi4", (2, 2, 33, 2, 16), torch.bfloat16, {"value_group": 4}),
    "kivi2-d4-no-rotation-possible": ("kivi2", (2, 1, 21, 1, 4), torch.bfloat16, {"rotate_values": False}),
    "kivi4-d6-odd-rows": ("kivi4", (2, 1, 17, 1, 6), torch.float16, {"key_tokens": 5, "sink_tokens": 0}),
    "kivi2-one-token": ("kivi2", (2, 2, 1, 1, 64), torch.bfloat16, {}),
    "kivi4-d4-rotated-f32": ("kivi4", (2, 1, 20, 3, 4), torch.float32, {}),
}


def _torch_decode(
    codec: str, payload: memoryview, params: dict, shape: tuple, dtype: torch.dtype
) -> torch.Tensor:
    lay = KiviLayout.from_params(shape, params, dtype, CODECS[codec])
    parts = lay.carve(payload_array(payload))
    out = torch.empty((2, shape[1], shape[2], lay.channels), dtype=dtype)
    kivi._decode_torch(parts, lay, lay.bits, out)
    if lay.sink:
        bits(out)[0, :, : lay.sink] = parts["sink"]
    return out.reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_the_c_decode_is_the_torch_decode_bit_for_bit(name: str) -> None:
    codec, shape, dtype, opts = KERNEL_CASES[name]
    assert cpu_kivi.kernel_available(), "kivi_kernels.c did not build"
    payload, params = get_codec(codec).encode(make_kv(shape, dtype, seed=sum(shape)), **opts)
    at_odd = memoryview(bytearray(b"\0" + bytes(payload)))[1:]  # a payload where a blob puts it: anywhere
    out = get_codec(codec).decode(at_odd, params, shape, dtype)
    assert torch.equal(_bits(out), _bits(_torch_decode(codec, payload, params, shape, dtype)))


def test_the_sse2_rotation_is_the_avx2_one() -> None:
    """A 64-value head is rotated back in AVX2 registers where the CPU has them; the SSE2 path (CPUs
    without AVX2, other head sizes) must give the same bits."""
    codec, shape, dtype, opts = KERNEL_CASES["kivi4-default-bf16"]
    payload, params = get_codec(codec).encode(make_kv(shape, dtype, seed=7), **opts)
    lib = cpu_kivi._lib()
    assert lib is not None
    try:
        assert lib.kivi_simd(0) == 0
        sse2 = get_codec(codec).decode(payload, params, shape, dtype)
    finally:
        lib.kivi_simd(1)
    assert torch.equal(_bits(sse2), _bits(get_codec(codec).decode(payload, params, shape, dtype)))
    assert torch.equal(_bits(sse2), _bits(_torch_decode(codec, payload, params, shape, dtype)))


def test_without_the_kernel_torch_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv((2, 2, 64, 2, 64), torch.bfloat16)
    payload, params = get_codec("kivi4").encode(kv)
    with_c = get_codec("kivi4").decode(payload, params, kv.shape, kv.dtype)
    monkeypatch.setenv("KVSTORE_KIVI_KERNEL", "0")
    cpu_kivi._lib.cache_clear()
    try:
        assert not cpu_kivi.kernel_available()
        assert torch.equal(
            _bits(get_codec("kivi4").decode(payload, params, kv.shape, kv.dtype)), _bits(with_c)
        )
    finally:
        monkeypatch.delenv("KVSTORE_KIVI_KERNEL")
        cpu_kivi._lib.cache_clear()


def test_hadamard_rows_is_the_orthonormal_hadamard_transform() -> None:
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(hadamard_rows(x.clone()), x @ hadamard(64), atol=1e-5)
    assert torch.allclose(hadamard_rows(hadamard_rows(x.clone())), x, atol=1e-5)  # its own inverse


@pytest.mark.parametrize(
    "codec,shape",
    [("kivi2", (2, 1, 21, 1, 4)), ("kivi4", (2, 1, 21, 1, 6)), ("kivi2+ans", (2, 1, 21, 1, 4))],
)
def test_metadata_at_an_odd_offset_is_written(codec: str, shape: tuple) -> None:
    """An odd code row and an odd token count put the scales at an odd offset of the payload: the
    encoder wrote them into a realigned copy and lost them (keys decoded as inf)."""
    kv = make_kv(shape, torch.bfloat16, seed=3)
    out = decode_blob(encode_blob(kv, codec=codec))
    check_bound(kv, out, codec.removesuffix("+ans"))
