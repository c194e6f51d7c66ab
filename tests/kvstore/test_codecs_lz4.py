"""The lz4 stage: lossless, framed with its size, safe against corrupt input, stackable after any codec."""

from __future__ import annotations

import os

import pytest
import torch

from kvstore.blob import COMPRESSION_LZ4, decode_blob, encode_blob, verify_blob
from kvstore.codecs.lz4 import compress, decompress, uncompressed_size
from kvstore.errors import CodecError


@pytest.mark.parametrize("data", [b"", b"a", os.urandom(4096), b"kv" * 50_000])
def test_round_trip(data: bytes) -> None:
    packed = compress(data)
    assert uncompressed_size(packed) == len(data)
    assert decompress(packed) == data
    assert decompress(memoryview(bytearray(packed))) == data


def test_corrupt_input_raises_codec_error() -> None:
    packed = bytearray(compress(b"kv" * 50_000))
    with pytest.raises(CodecError):
        decompress(packed[:3])
    with pytest.raises(CodecError, match="over the"):
        decompress(packed, max_size=1000)
    truncated = packed[: len(packed) // 2]
    with pytest.raises(CodecError):
        decompress(truncated)
    lying = bytearray(packed)
    lying[0:4] = (len(b"kv" * 50_000) + 7).to_bytes(4, "little")  # framing disagrees with the block
    with pytest.raises(CodecError):
        decompress(lying)


@pytest.mark.parametrize("codec", ["raw", "fp8", "int4"])
def test_stacks_after_every_codec(codec: str) -> None:
    kv = torch.zeros(2, 2, 32, 2, 64, dtype=torch.float16)
    kv[:, :, :4] = torch.randn(2, 2, 4, 2, 64).half()  # mostly zeros: lz4 pays and is kept
    blob = encode_blob(kv, codec=codec, lz4=True)
    assert verify_blob(blob).compression == COMPRESSION_LZ4
    assert len(blob) < len(encode_blob(kv, codec=codec))
    assert torch.equal(decode_blob(blob), decode_blob(encode_blob(kv, codec=codec)))
