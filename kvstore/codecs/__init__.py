"""Codec registry: the blob format looks codecs up here by name or id."""

from __future__ import annotations

from kvstore.codecs.base import Codec
from kvstore.codecs.fp8 import Fp8Codec
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.kivi import KiviCodec
from kvstore.codecs.raw import RawCodec
from kvstore.codecs.with_ans import codecs as ans_codecs
from kvstore.errors import CodecError

_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}


def register(codec: Codec) -> Codec:
    assert codec.name not in _BY_NAME and codec.codec_id not in _BY_ID, codec.name
    _BY_NAME[codec.name] = codec
    _BY_ID[codec.codec_id] = codec
    return codec


def get_codec(name_or_id: str | int) -> Codec:
    table = _BY_ID if isinstance(name_or_id, int) else _BY_NAME
    try:
        return table[name_or_id]
    except KeyError:
        raise CodecError(f"unknown codec {name_or_id!r}; known: {sorted(_BY_NAME)}") from None


def codec_names() -> list[str]:
    return sorted(_BY_NAME)


register(RawCodec())
register(Fp8Codec())
register(Int4Codec())
register(KiviCodec(4, codec_id=3))
register(KiviCodec(2, codec_id=4))
for _c in ans_codecs():  # kivi4+ans, kivi2+ans, int4+ans, fp8+ans
    register(_c)

__all__ = ["Codec", "register", "get_codec", "codec_names"]
