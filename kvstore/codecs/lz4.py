"""`lz4`: the lossless stage stackable after any codec (blob header compression=1).

Framing: a 4-byte little-endian uncompressed size, then one LZ4 block. The size is checked against
`max_size` before anything is allocated, and the block must decompress to exactly that size, so a
corrupt or hostile payload raises CodecError instead of allocating or returning garbage.

Measured on real SmolLM2 KV (benchmarks/bench_codecs.py --model): lz4 does not pay on KV — 1.00x on
fp16, 1.01x on fp8, 1.00x on int4 payloads, and a byte shuffle first gives at most 1.015x — so there is
no shuffle stage; `encode_blob` keeps the compressed form only where it is smaller, and lz4 stays off
by default. It is worth having for KV with long runs of zeros (padding, masked heads).
"""

from __future__ import annotations

import struct

import lz4.block

from kvstore.errors import CodecError

_SIZE = struct.Struct("<I")
MAX_SIZE = 1 << 31  # an LZ4 block cannot describe more than ~2 GiB


def compress(payload: bytes | bytearray | memoryview) -> bytes:
    """Compress `payload` into `size ‖ lz4 block`."""
    view = memoryview(payload).cast("B")
    if len(view) >= MAX_SIZE:
        raise CodecError(f"lz4 payload of {len(view)} bytes is over the {MAX_SIZE}-byte block limit")
    return _SIZE.pack(len(view)) + lz4.block.compress(view, store_size=False)


def uncompressed_size(payload: bytes | bytearray | memoryview) -> int:
    """The size `decompress` would return, read from the framing without decompressing."""
    view = memoryview(payload).cast("B")
    if len(view) < _SIZE.size:
        raise CodecError(f"lz4 payload of {len(view)} bytes is shorter than its size field")
    return _SIZE.unpack_from(view)[0]


def decompress(payload: bytes | bytearray | memoryview, max_size: int = MAX_SIZE) -> bytes:
    """Inverse of `compress`; raises CodecError on a corrupt payload or one that would exceed max_size."""
    view = memoryview(payload).cast("B")
    size = uncompressed_size(view)
    if size > max_size:
        raise CodecError(f"lz4 payload claims {size} bytes, over the {max_size}-byte limit")
    if size == 0:
        if len(view) > _SIZE.size + 1:  # lz4 encodes empty input as a single 0 token
            raise CodecError("lz4 payload has data after an empty block")
        return b""
    try:
        out = lz4.block.decompress(view[_SIZE.size :], uncompressed_size=size)
    except lz4.block.LZ4BlockError as e:
        raise CodecError(f"corrupt lz4 payload: {e}") from None
    if len(out) != size:
        raise CodecError(f"lz4 payload decompressed to {len(out)} bytes, framing says {size}")
    return out
