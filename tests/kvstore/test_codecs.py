"""fp8 and int4 codecs on the CPU path: error bounds, sizes, odd shapes, bad input, blobs, the SDK."""

from __future__ import annotations

import math

import pytest
import torch
from kvstore.sdk import Store

from kvstore.blob import decode_blob, encode_blob
from kvstore.codecs import codec_names, get_codec
from kvstore.codecs.common import hadamard
from kvstore.errors import CodecError, CorruptBlob

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def make_kv(shape: tuple[int, ...], dtype: torch.dtype = torch.float16, seed: int = 0) -> torch.Tensor:
    """KV with what real keys have: a few large outlier channels, and a big first token (a sink)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=g)
    kv[0, ..., 3] *= 12
    kv[0, :, 0] *= 8
    return kv.to(dtype)


def test_registry() -> None:
    names = ["raw", "fp8", "int4", "kivi4", "kivi2", "kivi4+ans", "kivi2+ans", "int4+ans", "fp8+ans"]
    assert codec_names() == sorted(names)
    assert [get_codec(n).codec_id for n in names] == list(range(9))


@pytest.mark.parametrize("name", codec_names())
def test_every_codec_decodes_as_the_protocol_says(name: str) -> None:
    """kvstore.codecs.base.Codec: decode(payload, params, shape, dtype, device=None) for every codec;
    device="cpu" gives the same tensor as no device."""
    import inspect  # noqa: PLC0415

    codec = get_codec(name)
    device = inspect.signature(codec.decode).parameters.get("device")
    assert device is not None and device.default is None and device.kind is device.POSITIONAL_OR_KEYWORD
    kv = make_kv((2, 1, 128, 2, 64), torch.float16)
    payload, params = codec.encode(kv)
    plain = codec.decode(memoryview(payload), params, tuple(kv.shape), kv.dtype)
    on_cpu = codec.decode(memoryview(payload), params, tuple(kv.shape), kv.dtype, device="cpu")
    assert on_cpu.device.type == "cpu" and torch.equal(plain, on_cpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["token", "tensor"])
def test_fp8_relative_error_bound(dtype: torch.dtype, mode: str) -> None:
    kv = make_kv((2, 2, 33, 3, 64), dtype)
    blob = encode_blob(kv, codec="fp8", fp8_scale=mode)
    out = decode_blob(blob)
    assert out.shape == kv.shape and out.dtype == dtype
    x, y = kv.double(), out.double()
    amax = x.abs().amax(-1, keepdim=True) if mode == "token" else x.abs().amax((1, 2, 3, 4), keepdim=True)
    scale = amax / 448
    # e4m3: 3 mantissa bits (half step 2^-4 relative), subnormal grid 2^-9 * scale; then the dtype rounding
    bound = (2.0**-4 + EPS[dtype]) * x.abs() * 1.001 + 2.0**-10 * scale * 1.001 + 1e-30
    assert bool(((x - y).abs() <= bound).all())
    assert (x - y).abs().max() > 0  # it is lossy: the test would notice a silent raw copy


@pytest.mark.parametrize("mode", ["token", "tensor"])
@pytest.mark.parametrize("shape", [(2, 1, 1, 1, 5), (2, 1, 3, 1, 7)])
def test_fp8_scales_at_an_odd_offset_are_written(shape: tuple, mode: str) -> None:
    """2 * L * T * H * D codes not a multiple of 4 put the float32 scales at an unaligned offset: the
    encoder wrote them into a realigned copy, and decoded values came out scaled by garbage."""
    kv = make_kv(shape, torch.bfloat16, seed=5)
    p, params = get_codec("fp8").encode(kv, fp8_scale=mode)
    out = get_codec("fp8").decode(p, params, shape, kv.dtype).float()
    scale = kv.float().abs().amax() if mode == "tensor" else kv.float().abs().amax(-1, keepdim=True)
    assert bool(((out - kv.float()).abs() <= scale * 2**-4 + 1e-6).all())  # e4m3: 3 mantissa bits


def test_fp8_size_and_zero_heads() -> None:
    kv = make_kv((2, 30, 256, 3, 64))
    kv[:, 1] = 0  # whole layer of zeros
    kv[1, 2, :, 1] = 0  # all-zero value heads
    p, params = get_codec("fp8").encode(kv)
    assert len(p) == kv.numel() + 4 * 2 * 30 * 256 * 3  # fp32 scale per token per head
    assert kv.numel() * 2 / len(p) == pytest.approx(2 * 64 / 68)
    out = get_codec("fp8").decode(p, params, tuple(kv.shape), kv.dtype)
    assert not out.isnan().any()
    assert torch.equal(out[:, 1], kv[:, 1]) and torch.equal(out[1, 2, :, 1], kv[1, 2, :, 1])
    p, _ = get_codec("fp8").encode(kv, fp8_scale="tensor")
    assert len(p) == kv.numel() + 8


@pytest.mark.parametrize("codec", ["fp8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_kv_is_rejected(codec: str, bad: float) -> None:
    kv = make_kv((2, 2, 64, 2, 64))
    kv[1, 1, 17, 1, 5] = bad
    with pytest.raises(CodecError, match="NaN|Inf"):
        encode_blob(kv, codec=codec)
    if codec == "fp8":
        with pytest.raises(CodecError):
            encode_blob(kv, codec=codec, fp8_scale="tensor")


def _int4_bound(x: torch.Tensor, groups: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound for asymmetric 4-bit: scale/2 + the fp16 rounding of scale and zero + dtype rounding."""
    mn, mx = groups.amin(dim, keepdim=True), groups.amax(dim, keepdim=True)
    b = (mx - mn) / 15 * (0.5 + 16 * 2.0**-11) + mn.abs() * 2.0**-11
    return b.expand_as(groups).reshape(x.shape) + x.abs() * EPS[dtype] + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [256, 100, 1])
def test_int4_error_bound_kivi_split(dtype: torch.dtype, tokens: int) -> None:
    g = 64
    kv = make_kv((2, 2, tokens, 3, 64), dtype)
    out = decode_blob(encode_blob(kv, codec="int4", group_size=g, sink_tokens=0))
    assert out.shape == kv.shape and out.dtype == dtype
    x, y = kv.double(), out.double()
    nl, nt, nh, d = x.shape[1:]
    # values: per token, groups of g along head_dim
    v = x[1]
    assert bool(((v - y[1]).abs() <= _int4_bound(v, v.reshape(nl, nt, nh, d // g, g), -1, dtype)).all())
    # keys: per channel over g tokens; the T % g tail per token
    tf = nt - nt % g
    k = x[0, :, :tf]
    if tf:
        kb = _int4_bound(k, k.reshape(nl, tf // g, g, nh, d), 2, dtype)
        assert bool(((k - y[0, :, :tf]).abs() <= kb).all())
    kt = x[0, :, tf:]
    kb = _int4_bound(kt, kt.reshape(nl, nt - tf, nh, d // g, g), -1, dtype)
    assert bool(((kt - y[0, :, tf:]).abs() <= kb).all())
    assert (x - y).abs().max() > 0


def test_int4_rotation_bound_holds_in_rotated_basis() -> None:
    kv = make_kv((2, 2, 64, 2, 128), torch.float32)
    out = decode_blob(encode_blob(kv, codec="int4", keys="token", rotate=True, group_size=32, sink_tokens=0))
    h = hadamard(128).double()
    x, y = kv.double() @ h, out.double() @ h
    bound = _int4_bound(x, x.reshape(2, 2, 64, 2, 4, 32), -1, torch.float32) + 1e-5
    assert bool(((x - y).abs() <= bound).all())


def test_int4_kivi_split_beats_per_token_keys_on_outlier_channels() -> None:
    kv = make_kv((2, 4, 256, 3, 64), torch.float32)
    err = {}
    for keys in ("channel", "token"):
        out = decode_blob(encode_blob(kv, codec="int4", keys=keys, sink_tokens=0))
        err[keys] = (out[0] - kv[0]).pow(2).mean().item()
    assert err["channel"] < 0.7 * err["token"]


def test_int4_sizes_partial_chunks_and_sink() -> None:
    codec = get_codec("int4")
    for tokens, sink in ((256, 1), (100, 1), (15, 0), (1, 0)):
        kv = make_kv((2, 3, tokens, 3, 64))
        p, params = codec.encode(kv)
        assert params["sink"] == sink
        rows = 2 * 3 * tokens * 3  # K and V head vectors
        assert (
            len(p) == rows * (32 + 4) + sink * 2 * 3 * 3 * 64 * 2
        )  # 64 codes in 32 bytes + fp16 scale, zero
        out = codec.decode(p, params, tuple(kv.shape), kv.dtype)
        assert torch.equal(out[:, :, :sink], kv[:, :, :sink])  # the sink token is exact
        if sink:
            assert not torch.equal(out[:, :, sink:], kv[:, :, sink:])
    kv = make_kv((2, 30, 256, 3, 64))
    assert kv.numel() * 2 / len(codec.encode(kv)[0]) > 3.5  # the default: >= 3.5x smaller than fp16
    assert kv.numel() * 2 / len(codec.encode(kv, group_size=32, sink_tokens=0)[0]) == pytest.approx(
        3.2, abs=0.01
    )


def test_one_token_chunk_is_quantised_not_stored_in_zero_points() -> None:
    kv = make_kv((2, 2, 1, 3, 128))
    p, params = get_codec("int4").encode(kv)
    assert params["sink"] == 0
    out = get_codec("int4").decode(p, params, tuple(kv.shape), kv.dtype)
    assert kv.numel() * 2 / len(p) == pytest.approx(256 / (64 + 8))  # per token, two g64 groups per head
    err = (out.float() - kv.float()).abs()
    assert err.max() > 0  # quantised, not a hidden fp16 copy


@pytest.mark.parametrize("codec", ["fp8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(2, 1, 1, 1, 64), (2, 2, 7, 3, 64), (2, 2, 17, 3, 128), (2, 1, 64, 8, 128)]
)
def test_odd_shapes_round_trip_through_blobs(codec: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    kv = make_kv(shape, dtype)
    for lz4 in (False, True):
        out = decode_blob(encode_blob(kv, codec=codec, lz4=lz4))
        assert out.shape == kv.shape and out.dtype == dtype
        rel = (out.float() - kv.float()).norm() / kv.float().norm()
        assert rel < (0.04 if codec == "fp8" else 0.15)


def test_non_contiguous_input() -> None:
    kv = make_kv((2, 2, 64, 3, 64)).transpose(2, 3).contiguous().transpose(2, 3)
    assert not kv.is_contiguous()
    for codec in ("fp8", "int4"):
        assert torch.equal(
            decode_blob(encode_blob(kv, codec=codec)), decode_blob(encode_blob(kv.contiguous(), codec=codec))
        )


@pytest.mark.parametrize(
    ("codec", "options", "match"),
    [
        ("int4", {"group_size": 48}, "group_size"),
        ("int4", {"group_size": 128}, "does not divide head_dim"),
        ("int4", {"keys": "token", "key_group_size": 128}, "does not divide head_dim"),
        ("int4", {"keys": "diagonal"}, "keys"),
        ("int4", {"rotate": "yes"}, "rotate"),
        ("int4", {"sink_tokens": -1}, "sink_tokens"),
        ("int4", {"bits": 3}, "unknown option"),
        ("fp8", {"fp8_scale": "block"}, "fp8_scale"),
        ("fp8", {"group_size": 64}, "unknown option"),
        ("raw", {"group_size": 64}, "no options"),
    ],
)
def test_bad_options_raise_codec_error(codec: str, options: dict, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode_blob(make_kv((2, 1, 8, 2, 64)), codec=codec, **options)


def test_bad_tensors_raise_codec_error() -> None:
    for codec in ("fp8", "int4"):
        c = get_codec(codec)
        with pytest.raises(CodecError, match="dtype"):
            c.encode(torch.ones(2, 1, 4, 1, 64, dtype=torch.int32))
        with pytest.raises(CodecError, match="shape"):
            c.encode(torch.ones(3, 1, 4, 1, 64))
        with pytest.raises(CodecError):
            c.encode([1, 2, 3])  # type: ignore[arg-type]
        with pytest.raises(CodecError, match="dtype"):
            encode_blob(torch.ones(2, 1, 4, 1, 64, dtype=torch.int8), codec=codec)
    with pytest.raises(CodecError, match="head_dim"):
        encode_blob(make_kv((2, 1, 8, 2, 96)), codec="int4", group_size=32, rotate=True)
    out = decode_blob(encode_blob(make_kv((2, 1, 8, 2, 96)), codec="int4", group_size=32))
    assert out.shape == (2, 1, 8, 2, 96)


def test_decode_rejects_wrong_payloads() -> None:
    kv = make_kv((2, 2, 64, 2, 64))
    for codec in ("fp8", "int4"):
        c = get_codec(codec)
        p, params = c.encode(kv)
        with pytest.raises(CodecError):
            c.decode(bytes(p)[:-1], params, tuple(kv.shape), kv.dtype)
        with pytest.raises(CodecError):
            c.decode(p, {}, tuple(kv.shape), kv.dtype)
        with pytest.raises(CodecError):
            c.decode(p, params, (2, 2, 64, 2, 32), kv.dtype)
    with pytest.raises(CodecError, match="group_size"):
        get_codec("int4").decode(p, {**params, "g": 48}, tuple(kv.shape), kv.dtype)
    blob = bytearray(encode_blob(kv, codec="int4"))
    blob[-3] ^= 0x10
    with pytest.raises(CorruptBlob):
        decode_blob(blob)


def test_decode_from_unaligned_and_readonly_buffers() -> None:
    kv = make_kv((2, 2, 64, 2, 64))
    for codec in ("fp8", "int4"):
        p, params = get_codec(codec).encode(kv)
        ref = get_codec(codec).decode(p, params, tuple(kv.shape), kv.dtype)
        shifted = memoryview(b"x" + bytes(p))[1:]
        assert torch.equal(get_codec(codec).decode(shifted, params, tuple(kv.shape), kv.dtype), ref)


def test_sdk_local_store_with_int4() -> None:
    kv = make_kv((2, 2, 64, 2, 64))
    with Store.local(tiers=["cpu"], codec="int4") as store:
        store.put("ab" * 16, kv)
        got = store.get("ab" * 16)
    assert got is not None and torch.equal(got, decode_blob(encode_blob(kv, codec="int4")))
    assert math.isclose(
        torch.nn.functional.cosine_similarity(got.flatten().float(), kv.flatten().float(), 0), 1, abs_tol=0.01
    )


def test_two_codec_threads_give_the_same_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv((2, 2, 100, 3, 64))
    for codec in ("fp8", "int4"):
        one = bytes(get_codec(codec).encode(kv)[0])
        monkeypatch.setenv("KVSTORE_CODEC_THREADS", "2")
        p, params = get_codec(codec).encode(kv)
        assert bytes(p) == one
        assert torch.equal(
            get_codec(codec).decode(p, params, tuple(kv.shape), kv.dtype),
            decode_blob(encode_blob(kv, codec=codec)),
        )
        monkeypatch.delenv("KVSTORE_CODEC_THREADS")
