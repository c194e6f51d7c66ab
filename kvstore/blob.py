"""The blob format: one self-describing, checksummed chunk (docs/design.md §2).

Layout, all little-endian:

    offset size field
    0      4    magic b"KVSB"
    4      2    format version (2; 1 is still read, see below)
    6      1    codec id (kvstore.codecs; docs/design.md §3: raw=0 ... fp8+ans=8)
    7      1    compression (0 none, 1 lz4), applied after the codec
    8      1    KV dtype id (1 float16, 2 bfloat16, 3 float32, 4 float8_e4m3fn, 5 float8_e5m2: fp8, raw only)
    9      1    ndim (5: [2, layers, tokens, kv_heads, head_dim]; [1, ...] for an MLA latent, raw only)
    10     2    reserved, zero
    12     20   shape, 5 x uint32
    32     4    params length P (msgpack map of codec parameters)
    36     8    payload length N
    44     8    checksum: xxh3_64 of bytes 0..44, then of everything from byte 52 on (key tag, params,
                payload)
    52     8    key tag: xxh3_64 of the key's ASCII (`key_tag`), 0 for a blob bound to no key
    60     P    params
    60+P   N    payload

A blob is written one way: `prepare_blob` encodes the tensor (a `PreparedBlob`: the header and params
in one small buffer, the codec's payload where the codec left it) and `write_into` lays it out in any
buffer of its size, hashing the payload as it copies it (the SDK: straight into a same-host server's
shared memory); `encode_blob` is its `to_bytes`.

Any flipped bit anywhere makes `decode_blob`/`verify_blob` raise CorruptBlob; nothing else escapes them.
So does a header whose payload length contradicts its codec, shape, dtype and params, checksum or not.

A blob is bound to the key it was encoded for (`encode_blob(kv, key=...)`; the SDK and the connectors
always pass it): a reader that names its key (`key=` of `verify_blob`, `decode_blob`, `copy_verified`;
the store on every put and every tier read) gets ForeignBlob, a CorruptBlob, for a blob bound to another
key: a blob copied or written under the wrong key is a miss, never another key's bytes. A blob encoded
with no key (tag 0) makes no claim and is accepted under any key, as is a version-1 blob (the same
layout without the key tag: 52-byte header, params at 52), which stays readable.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import xxhash

from kvstore.codecs import get_codec
from kvstore.codecs.raw import RawCodec
from kvstore.errors import CodecError, CorruptBlob, ForeignBlob, InvalidArgument
from kvstore.keys import validate_key

MAGIC = b"KVSB"
FORMAT_VERSION = 2
_HEAD = struct.Struct("<4sHBBBBH5IIQ")  # everything before the checksum
_CHECK = struct.Struct("<Q")  # the checksum, and (version 2) the key tag after it
V1_HEADER_SIZE = _HEAD.size + _CHECK.size  # version 1: no key tag
HEADER_SIZE = V1_HEADER_SIZE + _CHECK.size
HEADER_SIZES = {1: V1_HEADER_SIZE, FORMAT_VERSION: HEADER_SIZE}
assert HEADER_SIZE == 60

COMPRESSION_NONE, COMPRESSION_LZ4 = 0, 1
DTYPE_IDS = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = {v: k for k, v in DTYPE_IDS.items()}
MAX_PARAMS = 1 << 16


@dataclass(frozen=True)
class BlobHeader:
    codec_id: int
    compression: int
    dtype: torch.dtype
    shape: tuple[int, int, int, int, int]
    params: dict
    payload_offset: int
    payload_len: int
    key_tag: int = 0  # `key_tag` of the key the blob is bound to; 0: bound to none

    def check_key(self, key: str | None) -> None:
        """Raise ForeignBlob when the blob is bound to a key other than `key` (None: no check)."""
        if key is not None and self.key_tag and self.key_tag != key_tag(key):
            raise ForeignBlob(f"blob is bound to another key than {key}")

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def raw_nbytes(self) -> int:
        """Size of the decoded KV tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


def key_tag(key: str) -> int:
    """The tag binding a blob to `key` (never 0, which means bound to no key)."""
    return xxhash.xxh3_64_intdigest(validate_key(key).encode()) or 1


def _hashed(blob: bytes | bytearray | memoryview, *rest: Any) -> Any:
    """The running checksum of `blob` (a whole blob, or its start: the header, with the checksum field
    anywhere), then of each of `rest`: what the checksum covers is every byte but its own field, i.e.
    bytes 0..44 and everything from byte 52 on. The one place that spells the hole; every writer and
    reader hashes through it (`.update()` for more pieces, `.intdigest()` for the value)."""
    h = xxhash.xxh3_64(blob[: _HEAD.size])
    h.update(blob[V1_HEADER_SIZE:])
    for part in rest:
        h.update(part)
    return h


def prepare_blob(
    kv: torch.Tensor, codec: str = "raw", lz4: bool = False, key: str | None = None, **options: Any
) -> PreparedBlob:
    """Encode a KV tensor `[2, L, T, H, D]` into a blob not yet laid out in memory: its size is known,
    and `write_into` puts it wherever the caller wants it (the SDK: straight into shared memory), once.
    For raw the payload is a view of `kv`: keep `kv` unchanged until the blob is written.

    `lz4=True` compresses the codec's payload and keeps the compressed form only where it is smaller.
    """
    tag = 0 if key is None else key_tag(key)
    if not isinstance(kv, torch.Tensor):
        raise InvalidArgument(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[0] not in (1, 2) or kv.numel() == 0:
        raise InvalidArgument(
            f"kv must have shape [2, layers, tokens, kv_heads, head_dim] (or [1, ...]: an MLA latent), "
            f"got {tuple(kv.shape)}"
        )
    if kv.dtype not in DTYPE_IDS:
        raise CodecError(f"KV dtype must be one of {[str(d) for d in DTYPE_IDS]}, got {kv.dtype}")
    c = get_codec(codec)
    if kv.dtype in FP8_DTYPES and c.codec_id != RawCodec.codec_id:
        raise CodecError(f"an fp8 KV cache is stored as is (raw codec), not quantised again with {c.name}")
    if kv.shape[0] == 1 and c.codec_id != RawCodec.codec_id:
        raise CodecError(f"an MLA latent (one plane, not K and V) is stored raw, not with {c.name}")
    payload, params = c.encode(kv, **options)
    compression = COMPRESSION_NONE
    if lz4:
        from kvstore.codecs.lz4 import compress  # noqa: PLC0415 (optional stage)

        packed = compress(payload)
        if len(packed) < len(payload):
            payload, compression = packed, COMPRESSION_LZ4
    return PreparedBlob.of(c.codec_id, compression, kv.dtype, tuple(kv.shape), params, payload, tag)


def encode_blob(
    kv: torch.Tensor, codec: str = "raw", lz4: bool = False, key: str | None = None, **options: Any
) -> bytes:
    """Encode a KV tensor `[2, L, T, H, D]` into a blob, bound to `key` when given (see the module doc);
    `prepare_blob` laid out in a fresh `bytes`."""
    return prepare_blob(kv, codec, lz4, key, **options).to_bytes()


@dataclass(frozen=True)
class PreparedBlob:
    """A blob in two pieces: `head` (the header but its checksum, the key tag, the params) and the
    codec's `payload`. `nbytes` is its size; `write_into` lays it out in a buffer of that size (the
    copy and the checksum in one pass), `to_bytes` in a fresh `bytes`, `parts` as buffers to send
    back to back (the checksum filled in)."""

    head: bytes  # HEADER_SIZE + P bytes, the checksum field zero
    payload: memoryview

    @classmethod
    def of(
        cls,
        codec_id: int,
        compression: int,
        dtype: torch.dtype,
        shape: tuple,
        params: dict,
        payload: Any,
        tag: int,
    ) -> PreparedBlob:
        pbytes = msgpack.packb(params)
        view = memoryview(payload).cast("B")
        head = _HEAD.pack(
            MAGIC, FORMAT_VERSION, codec_id, compression, DTYPE_IDS[dtype], 5, 0, *shape, len(pbytes), len(view)
        )  # fmt: skip
        return cls(head + bytes(_CHECK.size) + _CHECK.pack(tag) + pbytes, view)

    @property
    def nbytes(self) -> int:
        return len(self.head) + len(self.payload)

    def _checksummed_head(self, checksum: int) -> bytes:
        return self.head[: _HEAD.size] + _CHECK.pack(checksum) + self.head[V1_HEADER_SIZE:]

    def parts(self) -> list[bytes | memoryview]:
        """The blob as two buffers (header, payload), nothing copied but the header."""
        return [self._checksummed_head(_hashed(self.head, self.payload).intdigest()), self.payload]

    def to_bytes(self) -> bytes:
        return b"".join(self.parts())

    def write_into(self, out: bytearray | memoryview) -> None:
        """Lay the blob out in `out` (exactly `nbytes`), hashing each piece of the payload right after
        it is copied, from the cache: the payload is read once."""
        d = memoryview(out).cast("B")
        if len(d) != self.nbytes:
            raise InvalidArgument(f"a {self.nbytes}-byte blob does not fit {len(d)} bytes")
        n = len(self.head)
        d[:n] = self.head
        h = _hashed(self.head)
        for pos in range(0, len(self.payload), _PIECE):
            piece = d[n + pos : n + pos + _PIECE]
            piece[:] = self.payload[pos : pos + _PIECE]
            h.update(piece)
        _CHECK.pack_into(d, _HEAD.size, h.intdigest())


def wrap_payload(header: BlobHeader, codec_id: int, payload: Any, params: dict, key: str | None) -> bytes:
    """A blob of the same KV as `header`'s, another codec's uncompressed payload (kvstore.codecs.
    transcode), bound to `key`."""
    tag = 0 if key is None else key_tag(key)
    return PreparedBlob.of(
        codec_id, COMPRESSION_NONE, header.dtype, header.shape, params, payload, tag
    ).to_bytes()


def verify_blob(
    data: bytes | bytearray | memoryview, checksum: bool = True, key: str | None = None
) -> BlobHeader:
    """Parse the header and verify the checksum of the whole blob; raise CorruptBlob on any fault,
    ForeignBlob (a CorruptBlob) when `key` is given and the blob is bound to another key.
    `checksum=False` checks everything but the checksum: for a buffer verified before, that nobody
    could have written since (a trusted tier's, see kvstore.tiers.base.Tier)."""
    view = memoryview(data).cast("B")
    if len(view) < V1_HEADER_SIZE:
        raise CorruptBlob(f"blob of {len(view)} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version, codec_id, compression, dtype_id, ndim, _, *rest = _HEAD.unpack_from(view)
    shape, (plen, nlen) = tuple(rest[:5]), rest[5:]
    if magic != MAGIC:
        raise CorruptBlob("bad magic: not a kvstore blob")
    if version not in HEADER_SIZES:
        raise CorruptBlob(f"unsupported blob format version {version}")
    size = HEADER_SIZES[version]
    if ndim != 5 or dtype_id not in DTYPES or compression not in (COMPRESSION_NONE, COMPRESSION_LZ4):
        raise CorruptBlob("bad header fields")
    if shape[0] not in (1, 2) or 0 in shape:
        raise CorruptBlob(
            f"bad KV shape {shape}: [2 (1: MLA), layers, tokens, kv_heads, head_dim], none empty"
        )
    if plen > MAX_PARAMS or size + plen + nlen != len(view):
        raise CorruptBlob(f"blob length {len(view)} does not match header ({size}+{plen}+{nlen})")
    (check,) = _CHECK.unpack_from(view, _HEAD.size)
    pstart, payload_offset = size, size + plen
    if checksum and _hashed(view).intdigest() != check:
        raise CorruptBlob("checksum mismatch")
    tag = _CHECK.unpack_from(view, V1_HEADER_SIZE)[0] if version > 1 else 0
    try:
        params = msgpack.unpackb(view[pstart:payload_offset]) if plen else {}
    except Exception as e:  # msgpack raises a zoo of types; a verified blob should never get here
        raise CorruptBlob(f"unreadable codec params: {e}") from None
    if not isinstance(params, dict):
        raise CorruptBlob("codec params are not a map")
    _check_payload_size(codec_id, compression, DTYPES[dtype_id], shape, params, view[payload_offset:])
    header = BlobHeader(codec_id, compression, DTYPES[dtype_id], shape, params, payload_offset, nlen, tag)
    header.check_key(key)
    return header


def bind_blob(blob: bytes | bytearray | memoryview, header: BlobHeader, key: str) -> bytes | memoryview:
    """`blob` (verified, `header` its header) bound to `key`: itself when it already is; a blob that
    makes no claim (tag 0, or format version 1) is copied into a version-2 blob with `key`'s tag and
    its checksum made again. The store binds every blob it keeps, so a file of one copied under
    another key is a miss, never another key's bytes."""
    if header.key_tag:
        return blob
    view = memoryview(blob).cast("B")
    old = HEADER_SIZES[struct.unpack_from("<H", view, 4)[0]]
    # the new header (the checksum field zero), the key's tag, the params; then the payload
    head = bytearray(view[: _HEAD.size]) + bytes(_CHECK.size) + _CHECK.pack(key_tag(key))
    head += view[old : header.payload_offset]
    struct.pack_into("<H", head, 4, FORMAT_VERSION)
    payload = view[header.payload_offset :]
    _CHECK.pack_into(head, _HEAD.size, _hashed(head, payload).intdigest())
    return b"".join((head, payload))


_PIECE = 256 * 1024  # copied, then hashed while it is still in the CPU's cache


def copy_verified(
    src: bytes | bytearray | memoryview, dst: bytearray | memoryview, key: str | None = None
) -> BlobHeader:
    """Copy the blob `src` into `dst` (the same size) and verify the copy as `verify_blob` does, one
    piece at a time: each is hashed right after it is copied, from the cache, so the blob's memory is
    read once, not twice. Raises CorruptBlob as `verify_blob` does (`dst` then holds garbage)."""
    s, d = memoryview(src).cast("B"), memoryview(dst).cast("B")
    n = len(s)
    if len(d) != n:
        raise InvalidArgument(f"copy of a {n}-byte blob into {len(d)} bytes")
    if n < V1_HEADER_SIZE:
        d[:] = s
        return verify_blob(d, key=key)
    first = min(n, _PIECE)  # holds the whole header
    d[:first] = s[:first]
    h = _hashed(d[:first])
    for pos in range(first, n, _PIECE):
        end = min(n, pos + _PIECE)
        d[pos:end] = s[pos:end]
        h.update(d[pos:end])
    header = verify_blob(d, checksum=False, key=key)
    if h.intdigest() != _CHECK.unpack_from(d, _HEAD.size)[0]:
        raise CorruptBlob("checksum mismatch")
    return header


def _check_payload_size(
    codec_id: int, compression: int, dtype: torch.dtype, shape: tuple, params: dict, payload: memoryview
) -> None:
    """A checksum proves the bytes are what the writer sent, not that the header tells the truth: the
    payload must be exactly what the codec makes of this shape, dtype and params (lz4: its framing)."""
    try:
        expected = get_codec(codec_id).payload_nbytes(params, shape, dtype)
    except CodecError as e:
        raise CorruptBlob(f"header does not describe a payload: {e}") from None
    if compression == COMPRESSION_LZ4:
        from kvstore.codecs.lz4 import uncompressed_size  # noqa: PLC0415 (optional stage)

        try:
            size = uncompressed_size(payload)
        except CodecError as e:
            raise CorruptBlob(str(e)) from None
        what = "lz4 payload decompresses to"
    else:
        size, what = len(payload), "payload is"
    if size != expected:
        raise CorruptBlob(f"{what} {size} bytes; codec {codec_id} of shape {shape} {dtype} needs {expected}")


def decode_blob(
    data: bytes | bytearray | memoryview,
    out: torch.Tensor | None = None,
    header: BlobHeader | None = None,
    key: str | None = None,
) -> torch.Tensor:
    """Verify and decode a blob into its KV tensor: a fresh CPU tensor, or `out` when given.

    `out` (the header's shape and dtype, any device) skips the fresh allocation, whose page faults
    cost more than the copy itself; a raw, uncompressed blob is then copied straight into it.
    `header`: what `verify_blob(data)` returned for this very, immutable buffer, when the caller has
    just verified it (the store does on every read); skips a second checksum pass.
    `key`: the key the blob was read under; ForeignBlob (a CorruptBlob) if it is bound to another.
    """
    if header is None:
        header = verify_blob(data, key=key)
    header.check_key(key)
    if out is not None and (tuple(out.shape) != header.shape or out.dtype != header.dtype):
        raise InvalidArgument(
            f"out is {tuple(out.shape)} {out.dtype}, the blob holds {header.shape} {header.dtype}"
        )
    payload = memoryview(data).cast("B")[header.payload_offset :]
    if (
        out is not None
        and header.codec_id == RawCodec.codec_id
        and header.compression == COMPRESSION_NONE
        and out.device.type == "cpu"
        and out.is_contiguous()
        and len(payload) == header.raw_nbytes
    ):
        out.view(torch.uint8).view(-1).numpy()[:] = payload
        return out
    try:
        if header.compression == COMPRESSION_LZ4:
            from kvstore.codecs.lz4 import decompress  # noqa: PLC0415

            payload = memoryview(decompress(payload))
        codec = get_codec(header.codec_id)
        kv = codec.decode(payload, header.params, header.shape, header.dtype)
    except CodecError as e:
        raise CorruptBlob(f"blob does not decode: {e}") from None
    if tuple(kv.shape) != header.shape or kv.dtype != header.dtype:
        raise CorruptBlob("decoded tensor does not match the header")
    if out is not None:
        return out.copy_(kv)
    return kv
