"""The HTTP wire of `kvstore.sdk.remote.RemoteBackend`: every store operation of kvstore.protocol.ops over
`kvstore.sdk.http.HttpClient` (docs/design.md §6), with the same methods as the data plane's
`kvstore.sdk.plane_transport.PlaneTransport`, so the backend never asks which wire it has.

A single key takes the operation's single-key route when it has one and the request sets no optional
field (GET /v1/chunks/{key}, PUT, HEAD, DELETE); anything else its batch route, with the request and
the answer written and read through the table (`ops.to_wire` / `ops.answer_from`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvstore.sdk.backend import Outgoing
from kvstore.sdk.http import HttpClient
from kvstore.sdk.transfers import Got, Receiver, body_of, nbytes

from kvstore.errors import InvalidArgument
from kvstore.protocol import Blob, ops, wire


class HttpTransport:
    name = "http"

    def __init__(self, http: HttpClient) -> None:
        self.http = http

    def get(self, keys: list[str], rx: Receiver, reasons: list[str | None] | None) -> Got:
        """The blobs of `keys` (None for misses) where `rx` puts them; `reasons` (if given) receives
        why each miss missed."""
        if len(keys) == 1 and reasons is None:
            resp = self.http.request("GET", wire.chunk_path(keys[0]), into=rx.into)
            found = resp.status != 404
            return rx.blobs([resp.body if found else None], resp.body if found else None)
        resp = self.http.request("POST", ops.GET.batch.path, [_json(ops.GET, ops.KeysRequest(keys))],
                                 wire.JSON_CONTENT_TYPE, rx.into)  # fmt: skip
        got_keys, views = wire.decode_frame(resp.body, allow_missing=True)
        if got_keys != keys:
            raise InvalidArgument("server answered a batch get with other keys than asked")
        blobs: list[Blob | None] = list(views)
        if reasons is not None:
            given = wire.parse_frame_header(resp.body, allow_missing=True).reasons or [None] * len(blobs)
            reasons[:] = [None if b is not None else (r if isinstance(r, str) else "not_stored")
                          for b, r in zip(blobs, given, strict=True)]  # fmt: skip
        return rx.blobs(blobs, memoryview(resp.body))

    def put(self, req: ops.PutRequest, blobs: Sequence[Outgoing]) -> ops.PutAnswer:
        """The tiers that stored each blob (the server's acknowledgement). HTTP carries no `replaces`:
        the answer says none was deleted (None), and the caller deletes them. Token hints ride in the
        batch frame's header (a single key with hints takes the batch route)."""
        if len(req.keys) == 1 and not _optional_set(ops.PUT, req):
            resp = self.http.request("PUT", wire.chunk_path(req.keys[0]), body_of(blobs))
            header = resp.headers.get(wire.STORED_IN_HEADER.lower()) or ""  # `cpu,disk`
            return ops.PutAnswer(1, [[t for t in header.split(",") if t]])
        fields = ops.to_wire(ops.PUT.request, req, ops.HTTP)
        frame = [wire.frame_header(req.keys, [nbytes(b) for b in blobs], more=fields), *body_of(blobs)]
        resp = self.http.request("POST", ops.PUT.batch.path, frame, wire.BATCH_CONTENT_TYPE)
        return ops.answer_from(ops.PUT, resp.json(), ops.HTTP)

    def call(self, op: ops.Op, req: Any) -> Any:
        """An operation whose request and answer are JSON (exists, delete, lookup)."""
        if len(req.keys) == 1 and op.one is not None and not _optional_set(op, req):
            resp = self.http.request(op.one.method, wire.chunk_path(req.keys[0]))
            assert op.types is not None
            return op.types[1].one(resp.status != 404)
        resp = self.http.request("POST", op.batch.path, [_json(op, req)], wire.JSON_CONTENT_TYPE)
        return ops.answer_from(op, resp.json(), ops.HTTP)

    def stats(self) -> dict[str, Any]:
        return self.http.request("GET", wire.STATS_PATH).json()

    def close(self) -> None:
        self.http.close()


def _json(op: ops.Op, req: Any) -> bytes:
    return json.dumps(ops.to_wire(op.request, req, ops.HTTP)).encode()


def _optional_set(op: ops.Op, req: Any) -> bool:
    """Whether the request sets a field HTTP carries that a single-key route cannot."""
    return any(f.optional and f.http is not None and getattr(req, f.name) is not None for f in op.request)
