"""The rANS stage: lossless round trips, the C kernel and the Python reference bit for bit, and damaged
streams refused (a fuzz of random mutations, bounded in count and time), never a crash or a hang."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvstore.blob import decode_blob, encode_blob, verify_blob
from kvstore.codecs import ans, get_codec
from kvstore.errors import CodecError, CorruptBlob
from tests.kvstore.test_blob import forge
from tests.kvstore.test_codecs import make_kv

pytestmark = pytest.mark.skipif(not ans.kernel_available(), reason="no C compiler for the rANS kernel")
ANS = ["kivi4+ans", "kivi2+ans", "int4+ans", "fp8+ans"]


def _packed(rng: np.random.Generator, n: int, bits: int, skew: float) -> np.ndarray:
    p = rng.dirichlet(np.full(1 << bits, skew))
    syms = np.zeros(-(-n * bits // 8) * (8 // bits), np.uint8)
    syms[:n] = rng.choice(1 << bits, size=n, p=p)
    per = 8 // bits
    return np.bitwise_or.reduce([syms[k::per] << (k * bits) for k in range(per)]).astype(np.uint8)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 1000, 4099])
def test_c_and_python_write_and_read_the_same_bytes(bits: int, n: int) -> None:
    rng = np.random.default_rng(n * 10 + bits)
    segs = [_packed(rng, n, bits, skew) for skew in (0.3, 1.0, 50.0)]
    segs.append(np.zeros_like(segs[0]))  # one symbol only: frequency 4096
    ns = [n] * len(segs)
    stream = ans.encode_segments(segs, ns, bits, use_c=True)
    assert stream == ans.encode_segments(segs, ns, bits, use_c=False)
    for use_c in (True, False):
        out = ans.decode_segments(stream, ns, bits, use_c=use_c)
        assert all(np.array_equal(a, b) for a, b in zip(out, segs, strict=True))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_decode_into_writes_each_segment_at_its_offset_as_the_reference_does(bits: int) -> None:
    """The one-call C stream decoder and the Python reference fill the same bytes, coded and raw
    segments alike, and leave the bytes between segments as they were."""
    rng = np.random.default_rng(bits)
    ns = [4099, 1, 64, 1000, 9]
    segs = [_packed(rng, n, bits, skew) for n, skew in zip(ns, (0.3, 1.0, 50.0, 1e6, 0.5), strict=True)]
    stream = ans.encode_segments(segs, ns, bits)
    assert stream[0] == 1 and ans.encode_segments(segs[1:2], ns[1:2], bits)[0] == 0  # coded and raw records
    offsets, pos = [], 3
    for s in segs:
        offsets.append(pos)
        pos += s.size + 5  # gaps between the segments
    outs = []
    for use_c in (True, False):
        out = np.full(pos, 0xA5, np.uint8)
        ans.decode_into(stream, ns, bits, out, offsets, use_c=use_c)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
    for s, at in zip(segs, offsets, strict=True):
        assert np.array_equal(outs[0][at : at + s.size], s)
    mask = np.ones(pos, bool)
    for s, at in zip(segs, offsets, strict=True):
        mask[at : at + s.size] = False
    assert (outs[0][mask] == 0xA5).all()
    with pytest.raises(CodecError):
        ans.decode_into(stream[:-1], ns, bits, np.zeros(pos, np.uint8), offsets)
    with pytest.raises(ValueError):
        ans.decode_into(stream, ns, bits, np.zeros(pos - 6, np.uint8), offsets)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_simd_groups_decode_as_the_scalar_c_path_and_the_reference(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of 4 coded segments (the AVX-512 path's, long enough for its bulk) of equal and of
    unequal n, a raw record inside a group, a constant segment in a group, a group left short at the
    end: the same codes from the vector path, the scalar C path and the Python reference."""
    rng = np.random.default_rng(100 + bits)
    ns = [20000] * 4 + [20001] * 2 + [3] + [20001] * 3 + [20000] * 4 + [9]
    skews = [0.3, 1.0, 5.0, 50.0, 0.5, 2.0, 1.0, 0.2, 1.0, 3.0, 1.0, 0.4, 0.0, 0.7, 1.0]
    segs = [
        _packed(rng, n, bits, s) if s else np.zeros(-(-n * bits // 8), np.uint8)
        for n, s in zip(ns, skews, strict=True)
    ]
    stream = ans.encode_segments(segs, ns, bits)
    outs = []
    for simd in ("1", "0"):
        monkeypatch.setenv("KVSTORE_ANS_SIMD", simd)
        outs.append(ans.decode_segments(stream, ns, bits))
    outs.append(ans.decode_segments(stream, ns, bits, use_c=False))
    for out in outs:
        assert all(np.array_equal(a, b) for a, b in zip(out, segs, strict=True))


@pytest.mark.parametrize("codec", ANS)
@pytest.mark.parametrize("shape", [(2, 3, 256, 3, 64), (2, 2, 37, 2, 64), (2, 1, 1, 1, 64)])
def test_lossless_over_the_base_codec(codec: str, shape: tuple) -> None:
    kv = make_kv(shape, torch.bfloat16, seed=sum(shape))
    base = codec.removesuffix("+ans")
    plain, coded = encode_blob(kv, codec=base), encode_blob(kv, codec=codec)
    assert torch.equal(decode_blob(coded).view(torch.int16), decode_blob(plain).view(torch.int16))
    assert verify_blob(coded).codec_id == get_codec(codec).codec_id


@pytest.mark.parametrize("shape", [(2, 3, 256, 3, 64), (2, 2, 37, 2, 64)])
def test_lossless_over_kivi_with_8bit_key_metadata(shape: tuple) -> None:
    kv = make_kv(shape, torch.bfloat16, seed=sum(shape))
    opts = {"key_meta": "8bit", "key_tokens": 16}
    plain, coded = encode_blob(kv, codec="kivi4", **opts), encode_blob(kv, codec="kivi4+ans", **opts)
    assert torch.equal(decode_blob(coded).view(torch.int16), decode_blob(plain).view(torch.int16))
    assert verify_blob(coded).params["km"] == 1


@pytest.mark.parametrize("codec", ANS)
def test_non_finite_kv_is_rejected(codec: str) -> None:
    kv = make_kv((2, 2, 32, 2, 64), torch.float32)
    kv[0, 1, 3, 1, 7] = float("nan")
    with pytest.raises(CodecError, match="NaN"):
        encode_blob(kv, codec=codec)


def _mutate(rng: np.random.Generator, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.integers(4)
    if kind == 0:  # flip 1-4 bits
        for bit in rng.integers(0, 8 * len(b), rng.integers(1, 5)):
            b[bit // 8] ^= 1 << (bit % 8)
    elif kind == 1:  # overwrite a run of bytes
        at = int(rng.integers(len(b)))
        b[at : at + int(rng.integers(1, 9))] = rng.bytes(int(rng.integers(1, 9)))
    elif kind == 2:  # truncate
        del b[int(rng.integers(len(b))) :]
    else:  # insert
        at = int(rng.integers(len(b) + 1))
        b[at:at] = rng.bytes(int(rng.integers(1, 5)))
    return bytes(b) if bytes(b) != data else bytes(b) + b"\0"


def _decode_or_none(
    stream: bytes, ns: list[int], bits: int, use_c: bool = True, simd: str = "1"
) -> list | None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTORE_ANS_SIMD", simd)
        try:
            return ans.decode_segments(stream, ns, bits, use_c=use_c)
        except CodecError:
            return None


def test_fuzz_damaged_streams_are_refused_or_decode_to_the_same_length_never_crash() -> None:
    """10,000 random mutations of a real-looking stream, decoded by the C kernel in bounded time: each
    is refused (CodecError) or decodes to codes of the right size; C and Python agree on a sample."""
    rng = np.random.default_rng(7)
    ns, bits = [8192] * 4 + [3000], 4  # a group of 4 for the AVX-512 path, then one alone
    segs = [_packed(rng, n, bits, 0.3) for n in ns]
    stream = ans.encode_segments(segs, ns, bits)
    assert stream[0] == 1 and len(stream) < sum(ns) // 2  # coded, not stored raw
    refused, t0 = 0, time.monotonic()
    for i in range(10_000):
        bad = _mutate(rng, stream)
        try:
            out = ans.decode_segments(bad, ns, bits)
        except CodecError:
            refused += 1
            out = None
        else:
            assert [len(o) for o in out] == [len(s) for s in segs]
        if i % 500 == 0:  # the reference and the scalar C path decide the same
            for ref in (
                _decode_or_none(bad, ns, bits, use_c=False),
                _decode_or_none(bad, ns, bits, simd="0"),
            ):
                assert (out is None) == (ref is None)
                assert out is None or all(np.array_equal(a, b) for a, b in zip(out, ref, strict=True))
    assert time.monotonic() - t0 < 60
    assert refused >= 9_900, refused  # the end-state and length checks catch nearly every damage


def test_fuzz_damaged_blobs_are_misses() -> None:
    """At the blob level every damage is a CorruptBlob (the checksum first, then the stream's checks
    for a forger who re-checksums)."""
    rng = np.random.default_rng(11)
    kv = make_kv((2, 2, 64, 2, 64), torch.bfloat16)
    good = encode_blob(kv, codec="kivi2+ans")
    h = verify_blob(good)
    payload, n = good[h.payload_offset :], h.params["ans"]
    t0, refused = time.monotonic(), 0
    for _ in range(2_000):
        with pytest.raises(CorruptBlob):
            decode_blob(_mutate(rng, good))
        bad = bytearray(payload)
        at = int(rng.integers(n))  # inside the rANS stream, re-checksummed: the decoder's checks
        bad[at] ^= 1 << int(rng.integers(8))
        try:
            decode_blob(forge(good, bytes(bad)))
        except CorruptBlob:
            refused += 1
    assert time.monotonic() - t0 < 60
    assert refused >= 1_950, refused


def test_forged_stream_lengths_are_corrupt() -> None:
    good = encode_blob(make_kv((2, 2, 64, 2, 64)), codec="fp8+ans")
    h = verify_blob(good)
    payload = good[h.payload_offset :]
    for n in (0, h.params["ans"] - 1, h.params["ans"] + 1, 10**12, -1):
        with pytest.raises(CorruptBlob):
            decode_blob(forge(good, payload, params={**h.params, "ans": n}))
