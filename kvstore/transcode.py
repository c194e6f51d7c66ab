"""Per-tier codecs: a blob re-encoded once, where it enters a tier that keeps another codec.

`StoreConfig.tier_codec` (`--tier-codec cpu=raw,disk=kivi4,redis=kivi4+ans`) names a codec for some
tiers; the store passes every blob it writes into such a tier (a put, a write-down, a promotion)
through `transcode`. The rules, chosen so that quality never degrades twice:
    - the tier's codec already: as is;
    - `X` into `X+ans` or back: only the lossless stage is added or removed (the codes are kept);
    - from `raw`, or into `raw`: decoded once and encoded with the tier's codec (default options), so
      a hit promoted into a raw top tier is decoded there once and read raw afterwards;
    - one lossy codec into another: kept as it is (re-quantising quantised KV adds error).
A blob that the tier's codec cannot encode (an fp8 KV cache: raw only; a shape the codec refuses) is
kept as it is too. Blobs stay bound to their key.
"""

from __future__ import annotations

import logging

from kvstore.blob import decode_blob, encode_blob, verify_blob, wrap_payload
from kvstore.codecs import get_codec
from kvstore.codecs.with_ans import AnsCodec
from kvstore.errors import CodecError, ConfigError

logger = logging.getLogger(__name__)
Blob = bytes | bytearray | memoryview


def check_tier_codecs(tier_codec: dict[str, str], tiers: list[str]) -> None:
    for tier, codec in tier_codec.items():
        if tier not in tiers:
            raise ConfigError(f"tier_codec names tier {tier!r}, which is not one of the tiers {tiers}")
        try:
            get_codec(codec)
        except CodecError as e:
            raise ConfigError(f"tier_codec {tier}={codec}: {e}") from None


def transcode(blob: Blob, key: str, codec: str) -> Blob:
    """`blob` (verified already) in `codec` by the rules above; the same object when it is kept."""
    header = verify_blob(blob, checksum=False, key=key)
    source, target = get_codec(header.codec_id), get_codec(codec)
    if source.codec_id == target.codec_id:
        return blob
    payload = memoryview(blob).cast("B")[header.payload_offset :]
    try:
        if (
            header.compression == 0
            and isinstance(target, AnsCodec)
            and target.base.codec_id == source.codec_id
        ):
            coded, params = target.wrap(payload, header.params, header.shape, header.dtype)
            return wrap_payload(header, target.codec_id, coded, params, key)
        if (
            header.compression == 0
            and isinstance(source, AnsCodec)
            and source.base.codec_id == target.codec_id
        ):
            plain, params = source.unwrap(payload, header.params, header.shape, header.dtype)
            return wrap_payload(header, target.codec_id, plain, params, key)
        if source.name != "raw" and target.name != "raw":
            return blob
        return encode_blob(decode_blob(blob, header=header), codec=codec, key=key)
    except CodecError as e:
        logger.debug("blob %s kept as %s, not %s: %s", key, source.name, codec, e)
        return blob
