"""The exception hierarchy shared by every room.

The SDK raises these to users; the server maps them to HTTP status codes (see `kvstore.protocol.wire`).
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""

    status = 500


class InvalidKey(KVStoreError, ValueError):
    """A chunk key that is not lowercase hex of an allowed length."""

    status = 400


class InvalidArgument(KVStoreError, ValueError):
    """A malformed request, parameter or tensor."""

    status = 400


class CorruptBlob(KVStoreError):
    """A blob whose header or checksum does not verify. Readers treat it as a miss."""

    status = 422


class ForeignBlob(CorruptBlob):
    """A valid blob bound to another key than the one it was stored or read under: a miss."""


class CodecError(InvalidArgument):
    """Unknown codec or parameters a codec cannot honour (bad group size, wrong dtype...)."""


class TooLarge(KVStoreError):
    """A blob or request body over the configured limit."""

    status = 413


class Unauthorized(KVStoreError):
    """Missing or wrong bearer token."""

    status = 401


class Forbidden(KVStoreError):
    """A request the server refuses whoever sends it: e.g. a Host header naming another site while no
    token is set (a DNS-rebinding page in a browser)."""

    status = 403


class UnsupportedMediaType(InvalidArgument):
    """A data route's body sent without its content type (or the X-KVStore-Wire header)."""

    status = 415


class NotFound(KVStoreError, KeyError):
    """A key that is not stored (only raised where a miss cannot be expressed as None)."""

    status = 404


class Unavailable(KVStoreError):
    """The server or a backing service cannot be reached (or is busy: retry after a moment)."""

    status = 503


class Busy(Unavailable):
    """The server is at one of its limits (connections, request bytes in flight): retry shortly.
    Sent as 503 with Retry-After."""

    retry_after = 1


class NotStored(KVStoreError):
    """A put that no tier stored: disk full, no file descriptors left, an I/O error... The message
    names each tier and its errno. (A put some tiers stored succeeds and names them.)"""

    status = 507


class ConfigError(KVStoreError, ValueError):
    """A configuration that cannot start (e.g. the gpu tier without CUDA)."""

    status = 400
