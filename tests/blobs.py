"""What the store keeps of a blob: tests that put a blob encoded with no key (or a version-1 blob)
compare what they read back with `kept(blob, key)`, the bytes the store holds for it under `key`."""

from __future__ import annotations

from kvstore.blob import _CHECK, _hashed, bind_blob, verify_blob


def kept(blob: bytes, key: str) -> bytes:
    """The bytes the store keeps for `blob` put under `key`: `blob` itself when it is bound to `key`
    already, else a version-2 copy bound to `key` (kvstore.blob.bind_blob). Raises as a put does
    (CorruptBlob, ForeignBlob) for a blob the store would refuse."""
    return bytes(bind_blob(blob, verify_blob(blob, key=key), key))


def sealed(head: bytes, rest: bytes) -> bytes:
    """A blob forged from `head` (the 44 header bytes before the checksum) and `rest` (what follows
    the checksum: key tag, params, payload), with the checksum over both filled in."""
    return head + _CHECK.pack(_hashed(head + bytes(_CHECK.size), rest).intdigest()) + rest
