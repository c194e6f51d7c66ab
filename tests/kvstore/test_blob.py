"""Spec 2: blobs round-trip bit-exactly, and nothing but CorruptBlob ever comes out of a bad one."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.blob import (
    _CHECK,
    _HEAD,
    HEADER_SIZE,
    MAGIC,
    V1_HEADER_SIZE,
    copy_verified,
    decode_blob,
    encode_blob,
    prepare_blob,
    verify_blob,
)
from kvstore.errors import CorruptBlob, InvalidArgument
from tests.blobs import sealed

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


VALID = encode_blob(_kv((2, 3, 5, 2, 8), torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 1, 1, 1, 1), (2, 3, 7, 5, 3), (2, 30, 17, 3, 64)])
def test_round_trip_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    kv = _kv(shape, dtype, seed=sum(shape))
    kv.view(-1)[0] = float("nan")
    kv.view(-1)[-1] = float("-inf")
    blob = encode_blob(kv)
    header = verify_blob(blob)
    assert (
        header.shape == shape
        and header.dtype == dtype
        and header.raw_nbytes == kv.numel() * kv.element_size()
    )
    out = decode_blob(blob)
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))  # bit-exact, NaN included
    pre = torch.empty_like(kv)
    assert decode_blob(blob, out=pre) is pre
    assert torch.equal(pre.view(torch.uint8), kv.view(torch.uint8))
    again = decode_blob(blob, header=header)  # already verified: no second checksum pass
    assert torch.equal(again.view(torch.uint8), kv.view(torch.uint8))


def test_non_contiguous_input_and_decoded_tensor_owns_its_memory() -> None:
    kv = _kv((2, 4, 6, 2, 8), torch.float16).transpose(2, 3).contiguous().transpose(2, 3)
    assert not kv.is_contiguous()
    blob = bytearray(encode_blob(kv))
    out = decode_blob(blob)
    assert torch.equal(out, kv)
    blob[-1] ^= 0xFF  # the decoded tensor must not alias the blob
    assert torch.equal(out, kv)


def test_decode_into_wrong_out_is_rejected() -> None:
    with pytest.raises(InvalidArgument):
        decode_blob(VALID, out=torch.empty(2, 3, 5, 2, 8, dtype=torch.float32))
    with pytest.raises(InvalidArgument):
        decode_blob(VALID, out=torch.empty(2, 3, 5, 2, 9, dtype=torch.float16))


def test_bad_tensors_are_rejected_when_encoding() -> None:
    with pytest.raises(InvalidArgument):
        encode_blob(torch.zeros(3, 1, 1, 1, 1))
    with pytest.raises(InvalidArgument):
        encode_blob(torch.zeros(2, 1, 1, 1))
    with pytest.raises(InvalidArgument):
        encode_blob(torch.zeros(2, 1, 1, 1, 1, dtype=torch.int32))
    with pytest.raises(InvalidArgument):
        encode_blob(b"not a tensor")  # type: ignore[arg-type]


def _must_be_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptBlob):
        verify_blob(data)
    with pytest.raises(CorruptBlob):
        decode_blob(data)
    with pytest.raises(CorruptBlob):
        copy_verified(data, bytearray(len(data)))


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_are_corrupt(data: bytes) -> None:
    _must_be_corrupt(data)


@FUZZ
@given(st.binary(min_size=HEADER_SIZE - 4, max_size=600))
def test_random_bytes_behind_the_magic_are_corrupt(tail: bytes) -> None:
    _must_be_corrupt(MAGIC + tail)


@FUZZ
@given(st.data())
def test_flipped_bits_anywhere_are_corrupt(data: st.DataObject) -> None:
    blob = bytearray(VALID)
    flips = data.draw(st.sets(st.integers(0, len(blob) * 8 - 1), min_size=1, max_size=8))
    for bit in flips:
        blob[bit // 8] ^= 1 << (bit % 8)
    _must_be_corrupt(bytes(blob))


@FUZZ
@given(st.integers(0, len(VALID) - 1), st.binary(max_size=64))
def test_truncated_or_extended_blobs_are_corrupt(cut: int, extra: bytes) -> None:
    _must_be_corrupt(VALID[:cut])
    if extra:
        _must_be_corrupt(VALID + extra)


# lz4 (compression 1) joins the fuzz once its codec module exists; every other value must be rejected
COMPRESSIONS = [0, 1]
DIM = st.one_of(st.integers(0, 5), st.integers(0, 2**32 - 1))


@FUZZ
@given(
    codec=st.one_of(st.integers(0, 3), st.integers(0, 255)),
    compression=st.one_of(st.sampled_from(COMPRESSIONS), st.integers(2, 255)),
    dtype_id=st.one_of(st.integers(0, 4), st.integers(0, 255)),
    shape=st.lists(DIM, min_size=5, max_size=5),
    params=st.one_of(
        st.binary(max_size=32),
        st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1), max_size=3),
    ),
    payload=st.one_of(st.binary(max_size=512), st.binary(min_size=2, max_size=2).map(lambda b: b * 60)),
    tag=st.one_of(st.none(), st.integers(0, 2**64 - 1)),  # None: a version-1 blob (no key tag)
)
def test_forged_headers_with_a_valid_checksum_never_escape(
    codec: int,
    compression: int,
    dtype_id: int,
    shape: list[int],
    params: object,
    payload: bytes,
    tag: int | None,
) -> None:
    """A header that passes the checksum but lies about codec, dtype, shape or params."""
    pbytes = params if isinstance(params, bytes) else msgpack.packb(params)
    version, tagged = (1, b"") if tag is None else (2, _CHECK.pack(tag))
    head = _HEAD.pack(MAGIC, version, codec, compression, dtype_id, 5, 0, *shape, len(pbytes), len(payload))
    blob = sealed(head, tagged + pbytes + payload)
    try:
        kv = decode_blob(blob)
    except CorruptBlob:
        return
    # the only way through is a header that truly describes the payload
    assert tuple(kv.shape) == tuple(shape) and shape[0] == 2 and 0 not in shape


def test_a_forged_header_that_tells_the_truth_decodes() -> None:
    """The forging above is sound: the same recipe with honest fields gives a good blob."""
    kv = _kv((2, 1, 3, 1, 4), torch.float32)
    payload = kv.numpy().tobytes()
    head = _HEAD.pack(MAGIC, 1, 0, 0, 3, 5, 0, 2, 1, 3, 1, 4, 0, len(payload))
    blob = sealed(head, payload)
    assert torch.equal(decode_blob(blob), kv)


def forge(
    blob: bytes, payload: bytes, shape: tuple[int, ...] | None = None, params: dict | None = None
) -> bytes:
    """`blob` with its payload (and optionally shape/params) replaced, re-checksummed: a forgery that
    passes the checksum."""
    head = list(_HEAD.unpack_from(blob))
    plen = head[12]
    pbytes = blob[HEADER_SIZE : HEADER_SIZE + plen] if params is None else msgpack.packb(params)
    assert head[1] == 2
    if shape is not None:
        head[7:12] = shape
    head[12], head[13] = len(pbytes), len(payload)
    packed, tag = _HEAD.pack(*head), blob[V1_HEADER_SIZE:HEADER_SIZE]
    return sealed(packed, tag + pbytes + payload)


def _payload(blob: bytes) -> bytes:
    return blob[verify_blob(blob).payload_offset :]


@pytest.mark.parametrize("codec", ["raw", "fp8", "int4"])
def test_payload_length_must_match_the_header_even_with_a_valid_checksum(codec: str) -> None:
    """Spec 2: a put whose payload length contradicts its header is refused, checksum or not."""
    good = encode_blob(_kv((2, 2, 64, 2, 64), torch.float16), codec=codec)
    payload = _payload(good)
    header = verify_blob(good)
    forgeries = {
        "short": forge(good, payload[:-2]),
        "long": forge(good, payload + b"\0\0"),
        "half": forge(good, payload[: len(payload) // 2]),
        "shape": forge(good, payload, shape=(2, 2, 32, 2, 64)),  # claims half the tokens
        "bigger-shape": forge(good, payload, shape=(2, 4, 64, 2, 64)),
        "huge-shape": forge(good, payload, shape=(2, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1)),
        "params": forge(good, payload, params={**header.params, "extra": 1}),
    }
    assert verify_blob(forge(good, payload)) == header  # the forging recipe itself is sound
    for name, blob in forgeries.items():
        with pytest.raises(CorruptBlob):
            verify_blob(blob)
        with pytest.raises(CorruptBlob):
            decode_blob(blob)
        assert name


def test_lz4_framing_must_match_the_header() -> None:
    kv = torch.zeros(2, 2, 64, 2, 64, dtype=torch.float16)  # zeros: lz4 pays, the blob is compressed
    good = encode_blob(kv, lz4=True)
    from kvstore.codecs.lz4 import compress, decompress

    inner = decompress(_payload(good))
    assert verify_blob(forge(good, compress(inner))).compression == 1
    for bad in (compress(inner[:-2]), compress(inner + b"\0\0"), b"\x01"):
        with pytest.raises(CorruptBlob):
            verify_blob(forge(good, bad))


BIG = encode_blob(_kv((2, 4, 300, 8, 64), torch.float16), codec="int4")  # 0.7 MiB: 3 pieces


@pytest.mark.parametrize("blob", [VALID, BIG], ids=["small", "pieces"])
def test_copy_verified_copies_and_verifies_in_one_pass(blob: bytes) -> None:
    out = bytearray(len(blob))
    assert copy_verified(blob, out) == verify_blob(blob) and bytes(out) == blob
    with pytest.raises(InvalidArgument):
        copy_verified(blob, bytearray(len(blob) + 1))


@FUZZ
@given(st.data())
def test_copy_verified_finds_flipped_bits_in_any_piece(data: st.DataObject) -> None:
    blob = bytearray(BIG)
    for bit in data.draw(st.sets(st.integers(0, len(blob) * 8 - 1), min_size=1, max_size=4)):
        blob[bit // 8] ^= 1 << (bit % 8)
    _must_be_corrupt(bytes(blob))


@pytest.mark.parametrize("codec,lz4", [("raw", False), ("raw", True), ("fp8", False), ("kivi4", False),
                                       ("kivi4+ans", False)])  # fmt: skip
def test_a_prepared_blob_laid_out_anywhere_is_the_encoded_blob(codec: str, lz4: bool) -> None:
    """`write_into` (the SDK's shared-memory put) and `to_bytes` (`encode_blob`) are one layout:
    the same bytes, the payload copied once and hashed as it goes, into a buffer of exactly its size."""
    kv = _kv((2, 2, 600, 2, 64), torch.bfloat16, seed=3)  # payload over the 256 KiB hashing piece
    key = "ab" * 16
    prepared = prepare_blob(kv, codec=codec, lz4=lz4, key=key)
    blob = encode_blob(kv, codec=codec, lz4=lz4, key=key)
    assert prepared.nbytes == len(blob)
    room = bytearray(prepared.nbytes + 10)
    prepared.write_into(memoryview(room)[5 : 5 + prepared.nbytes])
    assert bytes(room[5:-5]) == blob and room[:5] == room[-5:] == bytes(5)
    assert b"".join(prepared.parts()) == blob
    verify_blob(room[5:-5], key=key)
    with pytest.raises(InvalidArgument):
        prepared.write_into(bytearray(prepared.nbytes - 1))
