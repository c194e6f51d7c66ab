"""kvstore core: chunk keys, the blob format, codecs, tiers and the tiered store."""

__version__ = "0.1.0"
