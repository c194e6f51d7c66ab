"""The operations table (kvstore.protocol.ops) and the one handler per operation (kvstore.server.handlers):
the table names real fields and routes, its wire names round-trip, and an HTTP route and a data-plane op
call the same handler with the same request."""

from __future__ import annotations

import dataclasses

import pytest
from kvstore.sdk.remote import RemoteBackend
from kvstore.server import handlers

from kvstore.protocol import dataplane as dp
from kvstore.protocol import ops
from tests.server.conftest import key, make_blob

STORE_OPS = [op for op in ops.OPS if op.types is not None]


def _attributes(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} | {
        n for n, v in vars(cls).items() if isinstance(v, property)
    }


@pytest.mark.parametrize("op", ops.OPS, ids=lambda op: op.name)
def test_each_row_names_real_fields_a_code_and_routes(op: ops.Op) -> None:
    assert ops.BY_CODE[op.code] is op and dp.OP_NAMES[op.code] == op.name
    if op.types is not None:
        request, answer = op.types
        assert {f.name for f in op.request} <= _attributes(request)
        assert {f.name for f in op.answer} <= _attributes(answer)
        assert op.name in handlers.HANDLERS and op.batch is not None
    for fields in (op.request, op.answer):
        for wire_ in (ops.HTTP, ops.PLANE):
            names = [f.on(wire_) for f in fields if f.on(wire_) is not None]
            assert len(names) == len(set(names)), (op.name, wire_, names)


def test_the_routes_are_the_apps(server) -> None:
    """Every route of the table is a route of the server's app, under the table's name."""
    app_routes = {(r.method, r.resource.canonical): r.name for r in server.thread.server.app.router.routes()}
    for op in STORE_OPS:
        for route in (op.one, op.batch):
            if route is not None:
                assert app_routes.get((route.method, route.path)) == route.name, route
    names = [r.name for op in STORE_OPS for r in (op.one, op.batch) if r is not None]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (ops.LOOKUP, ops.LookupAnswer(3, 5, "evicted", [True, False])),
        (ops.LOOKUP, ops.LookupAnswer(0, 1, None)),
        (ops.EXISTS, ops.ExistsAnswer([True, False])),
        (ops.DELETE, ops.DeleteAnswer(each=[True, False, True])),
        (ops.PUT, ops.PutAnswer(2, [["cpu"], ["cpu", "disk"]], [True])),
        (ops.PUT, ops.PutAnswer(1, [["cpu"]])),
    ],
)
def test_answers_round_trip_on_both_wires(op: ops.Op, message: object) -> None:
    for wire_ in (ops.HTTP, ops.PLANE):
        data = ops.to_wire(op.answer, message, wire_)
        back = ops.answer_from(op, data, wire_)
        carried = {f.name for f in op.answer if f.on(wire_) is not None}
        for name in carried:
            assert getattr(back, name) == getattr(message, name), (op.name, wire_, name)


def test_the_wires_spell_the_same_fields_as_before() -> None:
    """The names both wires have always used (byte-compatible with older peers)."""
    answer = ops.LookupAnswer(2, 4, None, [True])
    assert ops.to_wire(ops.LOOKUP.answer, answer, ops.HTTP) == {
        "prefix": 2,
        "keys": 4,
        "miss": None,
        "also": [True],
    }
    assert ops.to_wire(ops.LOOKUP.answer, answer, ops.PLANE) == {"n": 2, "miss": None, "x": [True]}
    request = ops.LookupRequest([key(1)], [key(2)])
    assert ops.to_wire(ops.LOOKUP.request, request, ops.HTTP) == {"keys": [key(1)], "also": [key(2)]}
    assert ops.to_wire(ops.LOOKUP.request, request, ops.PLANE) == {"k": [key(1)], "x": [key(2)]}
    assert ops.to_wire(ops.LOOKUP.request, ops.LookupRequest([key(1)]), ops.PLANE) == {"k": [key(1)]}
    deleted = ops.DeleteAnswer(each=[True, False])
    assert ops.to_wire(ops.DELETE.answer, deleted, ops.HTTP) == {"deleted": 1}
    assert ops.to_wire(ops.DELETE.answer, deleted, ops.PLANE) == {"d": [True, False]}
    put = ops.PutRequest([key(1)], [10], [key(2)])
    assert ops.to_wire(ops.PUT.request, put, ops.PLANE) == {"k": [key(1)], "l": [10], "x": [key(2)]}


def test_a_bad_field_is_refused() -> None:
    with pytest.raises(Exception, match="needs 'k'"):
        ops.request_from(ops.LOOKUP, {"keys": [key(1)]}, ops.PLANE)
    with pytest.raises(Exception, match="hex"):
        ops.request_from(ops.LOOKUP, {"keys": [key(1)], "also": ["not a key"]}, ops.HTTP)


@pytest.mark.parametrize("transport", ["http", "tcp"])
def test_both_doors_call_the_same_handler(server, monkeypatch, transport: str) -> None:
    """Each operation, asked through either door, reaches the one handler with its request dataclass."""
    seen: list[tuple[str, type]] = []
    for name, fn in list(handlers.HANDLERS.items()):

        def spy(st, req, _fn=fn, _name=name):  # noqa: ANN001, ANN202
            seen.append((_name, type(req)))
            return _fn(st, req)

        monkeypatch.setitem(handlers.HANDLERS, name, spy)
        monkeypatch.setattr(handlers, name, spy)
    with RemoteBackend(server.url, transport=transport) as be:
        assert be.transport == transport
        be.put_blob(key(1), make_blob(1, key=key(1)))
        be.batch_put([(key(2), make_blob(2, key=key(2))), (key(3), make_blob(3, key=key(3)))])
        assert be.get_blob(key(1)) is not None and be.batch_get([key(2), key(4)])[1] is None
        assert be.batch_exists([key(1), key(4)]) == [True, False] and be.exists(key(1))
        assert be.lookup_and_exists([key(1), key(4)], [key(2)]) == (1, "not_stored", [True])
        assert be.delete(key(1)) and be.batch_delete([key(2), key(3), key(4)]) == 2
    assert [name for name, _ in seen] == ["put", "put", "get", "get", "exists", "exists", "lookup", "delete",
                                          "delete"]  # fmt: skip
    assert {name: cls for name, cls in seen} == {
        "put": ops.PutRequest, "get": ops.KeysRequest, "exists": ops.KeysRequest,
        "lookup": ops.LookupRequest, "delete": ops.KeysRequest,
    }  # fmt: skip


@pytest.mark.parametrize("transport", ["http", "tcp", "shm"])
def test_each_call_is_still_one_request(server, monkeypatch, transport: str) -> None:
    """A whole hit, a put, a batch and a lookup with its candidates: one request each on every wire
    (none at all for a hit the shm client reads through the arena index)."""
    from kvstore.sdk.dataplane import DataPlaneClient  # noqa: PLC0415
    from kvstore.sdk.http import HttpClient  # noqa: PLC0415

    sent: list[str] = []
    for cls, name in ((DataPlaneClient, "call"), (HttpClient, "request")):
        real = getattr(cls, name)
        monkeypatch.setattr(
            cls, name, lambda self, *a, _real=real, **kw: sent.append(str(a[0])) or _real(self, *a, **kw)
        )
    with RemoteBackend(server.url, transport=transport) as be:
        assert be.transport == transport
        blob = make_blob(1, tokens=512, key=key(1))
        for call, expected in [
            (lambda: be.put_blob(key(1), blob), 1),
            (lambda: be.get_blob(key(1)), 0 if transport == "shm" else 1),
            (lambda: be.batch_get([key(1), key(2)]), 1),
            (lambda: be.lookup_and_exists([key(1), key(2)], [key(3)]), 1),
            (
                lambda: be.batch_put([(key(4), make_blob(4, key=key(4)))], replaces=[key(1)]),
                2 if transport == "http" else 1,
            ),
        ]:
            sent.clear()
            call()
            assert len([s for s in sent if s not in (str(dp.SHM_ATTACH), str(dp.SHM_OPEN))]) == expected, sent
