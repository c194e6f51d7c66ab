"""kvstore.protocol.wire: batch frames round-trip and reject malformations; errors map back to their types."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import errors
from kvstore.protocol import wire

hex_keys = st.text(alphabet="0123456789abcdef", min_size=32, max_size=64)
payloads = st.one_of(st.none(), st.binary(max_size=300))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(hex_keys, payloads), max_size=12))
def test_frame_roundtrip(items):
    keys = [k for k, _ in items]
    blobs = [b for _, b in items]
    data = b"".join(bytes(p) for p in wire.encode_frame(keys, blobs))
    got_keys, got = wire.decode_frame(data, allow_missing=True)
    assert got_keys == keys
    assert [None if g is None else bytes(g) for g in got] == blobs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(hex_keys, st.binary(min_size=1, max_size=50)), min_size=1, max_size=5), st.data())
def test_any_cut_or_extension_is_rejected(items, data):
    frame = b"".join(bytes(p) for p in wire.encode_frame([k for k, _ in items], [b for _, b in items]))
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(errors.KVStoreError):
        wire.decode_frame(frame[:cut])
    with pytest.raises(errors.InvalidArgument):
        wire.decode_frame(frame + b"\x00")


def test_missing_only_where_allowed():
    frame = b"".join(bytes(p) for p in wire.encode_frame(["a" * 32], [None]))
    assert wire.decode_frame(frame, allow_missing=True) == (["a" * 32], [None])
    with pytest.raises(errors.InvalidArgument):
        wire.decode_frame(frame)


def test_payloads_are_views_not_copies():
    frame = bytearray(b"".join(bytes(p) for p in wire.encode_frame(["a" * 32], [b"xyz"])))
    _, (view,) = wire.decode_frame(frame)
    frame[-1] = ord("Z")
    assert bytes(view) == b"xyZ"


@pytest.mark.parametrize(
    "status,body,cls",
    [(400, {"error": "e", "type": "InvalidKey"}, errors.InvalidKey),
     (422, {"error": "e", "type": "CorruptBlob"}, errors.CorruptBlob),
     (413, {"error": "e", "type": "TooLarge"}, errors.TooLarge),
     (401, {"error": "e", "type": "Unauthorized"}, errors.Unauthorized),
     (405, {"error": "e", "type": "MethodNotAllowed"}, errors.InvalidArgument),
     (503, {"error": "e", "type": "Unavailable"}, errors.Unavailable),
     (500, {"error": "e", "type": "KVStoreError"}, errors.KVStoreError),
     (413, None, errors.TooLarge), (502, "<html>bad gateway</html>", errors.Unavailable),
     (418, "teapot", errors.KVStoreError)],
)  # fmt: skip
def test_error_from_response(status, body, cls):
    raw = json.dumps(body).encode() if isinstance(body, dict) else (body.encode() if body else None)
    exc = wire.error_from_response(status, raw)
    assert type(exc) is cls and exc.status == status
    if isinstance(body, dict):
        assert str(exc) == "e"


def test_every_error_type_has_a_wire_name():
    assert {"InvalidKey", "InvalidArgument", "CorruptBlob", "CodecError", "TooLarge", "Unauthorized",
            "NotFound", "Unavailable", "ConfigError", "KVStoreError"} <= set(wire.ERROR_TYPES)  # fmt: skip
    body = wire.error_body(errors.TooLarge("big"))
    assert body == {"error": "big", "type": "TooLarge"}
    assert type(wire.error_from_response(413, json.dumps(body).encode())) is errors.TooLarge
