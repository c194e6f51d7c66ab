"""An fp8 (e4m3) KV cache's chunks: stored raw and bit-exact, never quantised a second time."""

from __future__ import annotations

import pytest
import torch

from kvstore.blob import decode_blob, encode_blob, verify_blob
from kvstore.errors import CodecError, CorruptBlob


def _fp8_kv(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, 16, 2, 8, generator=g) * 40).to(torch.float8_e4m3fn)


def test_fp8_round_trips_bit_exact_at_one_byte_per_value() -> None:
    kv = _fp8_kv()
    blob = encode_blob(kv)
    header = verify_blob(blob)
    assert header.dtype == torch.float8_e4m3fn and header.payload_len == kv.numel()
    out = decode_blob(blob)
    assert out.dtype == torch.float8_e4m3fn and torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    with pytest.raises(CorruptBlob):
        decode_blob(blob[:-1])


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_fp8_kv_refuses_a_second_quantisation(codec: str) -> None:
    with pytest.raises(CodecError, match="raw"):
        encode_blob(_fp8_kv(), codec=codec)
