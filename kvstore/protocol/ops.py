"""Every operation of the protocol, once, for both wires (docs/design.md §6, §7).

`OPS` has one row per operation: its name, its data-plane op code, its HTTP routes (one for a single
key, the key in the path; one for a batch), and the fields of its request and of its answer, each with
its name on each wire: in the JSON body (or a batch frame's header) on HTTP, in the msgpack meta on the
data plane. So `keys` is "keys" on HTTP and "k" on the data plane, LOOKUP's `also` is "also" and "x",
its `prefix` "prefix" and "n". The request and answer of an operation are the dataclasses below; the
server has one handler per operation that takes the request and returns the answer whichever door it
came in by (kvstore.server.handlers), and each SDK transport reads and writes them through this table
(`to_wire` / `from_wire`). Adding a field to an operation is a Field and a dataclass attribute here,
its use in the handler and in the SDK's caller: neither wire's code changes.

Conventions the rows do not spell field by field:
- A single-key route (`one`) carries its key in the path and a blob as the raw body; it answers a
  boolean (exists, deleted) as its status (200 or 204 / 404), a put's `stored_in` in
  X-KVStore-Stored-In, a miss's reason in X-KVStore-Miss-Reason. A client takes it for one key when
  the request sets no optional field.
- Blobs (GET's answer, PUT's request) are the body: a raw blob or a batch frame on HTTP (the frame's
  header holds `keys`, `lens` and, answering a get, `reasons`); back to back after the meta or in a
  shared-memory region on the data plane, where `l` gives their lengths (-1 for a miss) and the region
  fields of `PLANE_REGION` say where (docs/design.md §8).
- On the data plane a single-key answer whose one boolean is false (a miss, absent, not deleted) has
  status 404, as the single-key route's does.
- An optional field is left out when it is None, so a peer that predates it never sees it; a peer
  that predates it answers without it (None here) and the caller does what it asked another way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.keys import validate_key
from kvstore.protocol import Blob, wire
from kvstore.protocol import dataplane as dp

HTTP, PLANE = "http", "plane"


def keys(value: Any) -> list[str]:
    """A list of at most MAX_BATCH_KEYS valid keys."""
    if not isinstance(value, list):
        raise InvalidArgument("keys must be a list of hex keys")
    if len(value) > wire.MAX_BATCH_KEYS:
        raise InvalidArgument(f"batch of {len(value)} keys is over {wire.MAX_BATCH_KEYS}")
    for key in value:
        validate_key(key)
    return value


def _as_is(value: Any) -> Any:
    return value


def _count(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"expected a count, got {value!r:.40}")
    return value


def _bools(value: Any) -> list[bool]:
    if not isinstance(value, list):
        raise InvalidArgument("expected a list of booleans")
    return [bool(x) for x in value]


def _reason(value: Any) -> str | None:
    return value if isinstance(value, str) else None


MAX_HINT_TOKENS = 65536  # the most token ids a put may give one chunk (its blob says how many it holds)
MAX_TOKEN_ID = 2**31 - 1  # token ids are non-negative int32s: Dynamo reads them as u32, keys as int32


def token_lists(value: Any) -> list[list[int] | None]:
    """A put's `token_ids`: per key, the chunk's token ids (non-negative int32s, 1 to MAX_HINT_TOKENS of
    them) or None. Events-only hints (kvstore.token_hints): never part of a key or of what is stored."""
    if not isinstance(value, list) or len(value) > wire.MAX_BATCH_KEYS:
        raise InvalidArgument("token_ids must be a list (one entry per key) of token id lists or nulls")
    for ids in value:
        if ids is None:
            continue
        if not isinstance(ids, list) or not 0 < len(ids) <= MAX_HINT_TOKENS:
            raise InvalidArgument(f"a chunk's token_ids must be a list of 1 to {MAX_HINT_TOKENS} token ids")
        if not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
            raise InvalidArgument("token ids must be integers from 0 to 2**31 - 1")
    return value


def parent_keys(value: Any) -> list[str | None]:
    """A put's `parents`: per key, the key of the chunk before it in its sequence, None for a first."""
    if not isinstance(value, list) or len(value) > wire.MAX_BATCH_KEYS:
        raise InvalidArgument("parents must be a list (one entry per key) of keys or nulls")
    for key in value:
        if key is not None:
            validate_key(key)
    return value


@dataclass(frozen=True)
class Field:
    name: str  # the attribute of the request or answer dataclass
    http: str | None  # its name on HTTP; None: HTTP does not carry it
    plane: str | None  # its name in the data plane's meta; None: the data plane does not carry it
    check: Callable[[Any], Any] = _as_is  # checks a value read from the wire (InvalidArgument)
    optional: bool = False  # absent (or null) reads as None, and None is left out...
    null: bool = False  # ...unless it is written as null all the same (what older peers always sent)

    def on(self, wire_: str) -> str | None:
        return self.http if wire_ == HTTP else self.plane


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    name: str  # the route's name: the label of the request metrics, on both wires


@dataclass(frozen=True)
class Op:
    name: str
    code: int  # the data-plane op
    one: Route | None  # HTTP, a single key (in the path); None: a single key takes `batch` too
    batch: Route | None  # HTTP, any number of keys; None: the data plane only
    request: tuple[Field, ...]
    answer: tuple[Field, ...]
    types: tuple[type, type] | None = None  # the request's and the answer's dataclass

    def route_name(self, n_keys: int) -> str:
        route = self.one if n_keys == 1 and self.one is not None else self.batch
        return route.name if route is not None else dp.OP_NAMES[self.code]


# -- the requests and answers ----------------------------------------------------------------------------


@dataclass
class KeysRequest:  # GET, EXISTS, DELETE
    keys: list[str]


@dataclass
class GetAnswer:
    blobs: list[Blob | None]
    reasons: list[str | None] | None = None  # why each miss missed (kvstore/miss_log.py); None: no miss
    lens: list[int] = field(init=False)  # each blob's length, -1 for a miss

    def __post_init__(self) -> None:
        self.lens = [dp.MISSING if b is None else memoryview(b).nbytes for b in self.blobs]

    def found(self) -> bool:
        return self.blobs[0] is not None


@dataclass
class PutRequest:
    keys: list[str]
    lens: list[int]
    replaces: list[str] | None = None  # keys the new blobs supersede: deleted once every one is stored
    blobs: list[Any] = field(default_factory=list, repr=False)  # the body: one buffer per blob
    # events-only hints (kvstore.token_hints), per key: the chunk's token ids, and the key before it
    token_ids: list[list[int] | None] | None = field(default=None, repr=False)
    parents: list[str | None] | None = None


@dataclass
class PutAnswer:
    stored: int
    stored_in: list[list[str]]  # the tiers that stored each blob
    replaced: list[bool] | None = None  # whether each of `replaces` was deleted


@dataclass
class ExistsAnswer:
    exists: list[bool]

    @classmethod
    def one(cls, found: bool) -> ExistsAnswer:
        return cls([found])

    def found(self) -> bool:
        return bool(self.exists[0])


@dataclass
class DeleteAnswer:
    deleted: int | None = None  # how many were stored (HTTP's batch answer)
    each: list[bool] | None = None  # whether each one was (the data plane's answer)

    def __post_init__(self) -> None:
        if self.deleted is None and self.each is not None:
            self.deleted = sum(bool(x) for x in self.each)

    @classmethod
    def one(cls, found: bool) -> DeleteAnswer:
        return cls(int(found), [found])

    def found(self) -> bool:
        return bool(self.deleted)


@dataclass
class LookupRequest:
    keys: list[str]
    also: list[str] | None = None  # more keys: whether each is stored, in the same round trip


@dataclass
class LookupAnswer:
    prefix: int  # how many leading keys are stored
    asked: int | None = None  # how many keys were asked (HTTP)
    miss: str | None = None  # why key `prefix` is not stored (None when all are)
    also: list[bool] | None = None


# -- the table -------------------------------------------------------------------------------------------

_KEYS = Field("keys", "keys", "k", keys)
_CHUNK = wire.CHUNKS_PATH + "/{key}"
GET = Op("get", dp.GET, Route("GET", _CHUNK, "get"), Route("POST", wire.BATCH_GET_PATH, "batch_get"),
         (_KEYS,),
         (Field("lens", "lens", "l"), Field("reasons", "reasons", "r", optional=True)),
         (KeysRequest, GetAnswer))  # fmt: skip
PUT = Op("put", dp.PUT, Route("PUT", _CHUNK, "put"), Route("POST", wire.BATCH_PUT_PATH, "batch_put"),
         (_KEYS, Field("lens", "lens", "l"), Field("replaces", None, "x", keys, optional=True),
          Field("token_ids", "token_ids", "t", token_lists, optional=True),
          Field("parents", "parents", "tp", parent_keys, optional=True)),
         (Field("stored", "stored", "stored", _count), Field("stored_in", "stored_in", "stored_in"),
          Field("replaced", None, "x", _bools, optional=True)),
         (PutRequest, PutAnswer))  # fmt: skip
EXISTS = Op("exists", dp.EXISTS, Route("HEAD", _CHUNK, "head"),
            Route("POST", wire.BATCH_EXISTS_PATH, "batch_exists"),
            (_KEYS,), (Field("exists", "exists", "e", _bools),), (KeysRequest, ExistsAnswer))  # fmt: skip
DELETE = Op("delete", dp.DELETE, Route("DELETE", _CHUNK, "delete"),
            Route("POST", wire.BATCH_DELETE_PATH, "batch_delete"),
            (_KEYS,), (Field("deleted", "deleted", None, _count), Field("each", None, "d", _bools)),
            (KeysRequest, DeleteAnswer))  # fmt: skip
LOOKUP = Op("lookup", dp.LOOKUP, None, Route("POST", wire.LOOKUP_PATH, "lookup"),
            (_KEYS, Field("also", "also", "x", keys, optional=True)),
            (Field("prefix", "prefix", "n", _count), Field("asked", "keys", None, _count, optional=True),
             Field("miss", "miss", "miss", _reason, optional=True, null=True),
             Field("also", "also", "x", _bools, optional=True)),
            (LookupRequest, LookupAnswer))  # fmt: skip
# the data plane's own operations (no HTTP route): their metas, for the record; kvstore.server.dataplane_ops
HELLO = Op("hello", dp.HELLO, None, None, (Field("version", None, "v"), Field("token", None, "token")),
           tuple(Field(n, None, n, optional=n in ("unix", "arena", "index")) for n in
                 ("v", "max_blob", "max_request", "max_keys", "shm", "host", "unix", "arena", "index")))  # fmt: skip
SHM_OPEN = Op("shm_open", dp.SHM_OPEN, None, None, (Field("size", None, "size"),),
              tuple(Field(n, None, n, optional=n != "seg") for n in ("seg", "path", "size", "nonce")))  # fmt: skip
SHM_ATTACH = Op("shm_attach", dp.SHM_ATTACH, None, None, (Field("seg", None, "seg"), Field("nonce", None, "nonce")),
                ())  # fmt: skip
TOUCH = Op("touch", dp.TOUCH, None, None, (_KEYS, Field("gets", None, "g")), ())  # one-way: never answered
OPS = (GET, PUT, EXISTS, DELETE, LOOKUP, HELLO, SHM_OPEN, SHM_ATTACH, TOUCH)
BY_CODE = {op.code: op for op in OPS}
# where a FLAG_SHM request's blobs lie: request `s` [segment, offset, capacity], `u` pins given back,
# `a` the arena's nonce (a get that may be lent); answer `o` (where the blobs start) or `a` and `p`
PLANE_REGION = ("s", "u", "a", "o", "p")


# Each fields tuple is written and read on each wire by a function made once from it (as namedtuple
# makes its class), so a message costs what hand-written code would: a few dict operations.
_CODE: dict[tuple, tuple[tuple[Field, ...], Callable]] = {}  # the entry keeps the tuple, so its id


def _compiled(fields: tuple[Field, ...], wire_: str, cls: type | None) -> Callable:
    key = (id(fields), wire_, cls)
    hit = _CODE.get(key)
    if hit is not None and hit[0] is fields:
        return hit[1]
    plan = [(f.name, name, f.check, f.optional, f.optional and not f.null)
            for f in fields if (name := f.on(wire_)) is not None]  # fmt: skip
    env: dict[str, Any] = {"InvalidArgument": InvalidArgument, "cls": cls}
    if cls is None:  # a writer: message -> dict
        lines = ["def code(m):", "    out = {}"]
        for attr, name, _, _, omit in plan:
            lines += [
                f"    v = m.{attr}",
                f"    if v is not None: out[{name!r}] = v" if omit else f"    out[{name!r}] = v",
            ]
        lines.append("    return out")
    else:  # a reader: (dict, values that came another way) -> cls
        what = "JSON object" if wire_ == HTTP else "map"
        lines = ["def code(data, values):", "    if type(data) is not dict:",
                 f"        raise InvalidArgument({f'expected a {what} of {cls.__name__}'!r})"]  # fmt: skip
        for i, (attr, name, check, optional, _) in enumerate(plan):
            env[f"check{i}"] = check
            absent = "pass" if optional else f"raise InvalidArgument({f'{cls.__name__} needs {name!r}'!r})"
            value = "v" if check is _as_is else f"check{i}(v)"
            lines += [f"    if {attr!r} not in values:", f"        v = data.get({name!r})",
                      f"        if v is None: {absent}", f"        else: values[{attr!r}] = {value}"]  # fmt: skip
        lines.append("    return cls(**values)")
    exec("\n".join(lines), env)  # noqa: S102 (source made here from the table's own names)
    _CODE[key] = (fields, env["code"])
    return env["code"]


def writer(fields: tuple[Field, ...], wire_: str) -> Callable[[Any], dict[str, Any]]:
    """`to_wire` of these fields on this wire, as one function (for a hot path to keep)."""
    return _compiled(fields, wire_, None)


def reader(cls: type, fields: tuple[Field, ...], wire_: str) -> Callable[[Any, dict[str, Any]], Any]:
    """`from_wire` of `cls` on this wire, as one function of (data, fields that came another way)."""
    return _compiled(fields, wire_, cls)


def to_wire(fields: tuple[Field, ...], message: Any, wire_: str) -> dict[str, Any]:
    """`message`'s fields as one wire names them (HTTP's JSON body, or the data plane's meta)."""
    return _compiled(fields, wire_, None)(message)


def from_wire(cls: type, fields: tuple[Field, ...], data: Any, wire_: str, **more: Any) -> Any:
    """The `cls` a wire's message describes, each field checked (absent or null: None where it is
    optional, InvalidArgument where not); `more`: fields that travelled elsewhere, checked already."""
    return _compiled(fields, wire_, cls)(data, more)


def status(answer: Any, n_keys: int, ok: int = 200) -> int:
    """404 for a single-key answer whose one boolean is false (a miss, absent, not deleted), on either
    wire; else `ok`."""
    found = getattr(answer, "found", None)
    return 404 if n_keys == 1 and found is not None and not found() else ok


def request_from(op: Op, data: Any, wire_: str, **more: Any) -> Any:
    """`op`'s request as `wire_` carries it (`more`: fields that came another way, checked already)."""
    assert op.types is not None, op.name
    return _compiled(op.request, wire_, op.types[0])(data, more)


def answer_from(op: Op, data: Any, wire_: str, **more: Any) -> Any:
    assert op.types is not None, op.name
    return _compiled(op.answer, wire_, op.types[1])(data, more)
