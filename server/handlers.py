"""One handler per operation of the protocol (kvstore.protocol.ops), for both front doors.

The HTTP routes (kvstore.server.routes) and the data plane (kvstore.server.dataplane_ops) read a
request off their wire into the operation's request dataclass, call the same handler here, and write
its answer back in their own framing: what an operation does to the store, and which metrics it
counts, cannot differ between the doors. A handler is synchronous (it calls the store, which may block
on a disk or Valkey); each door runs it where it runs store calls (`ServerState.call`, or the data
plane's thread). The doors keep what is theirs: limits, auth, bodies, shared memory.
"""

from __future__ import annotations

import logging

from kvstore.server.state import ServerState

from kvstore.errors import KVStoreError
from kvstore.protocol import ops
from kvstore.token_hints import note_hints

log = logging.getLogger(__name__)


def get(st: ServerState, req: ops.KeysRequest) -> ops.GetAnswer:
    """The blobs of the keys (None for a miss) and, when one missed, why each miss missed."""
    keys, reasons = req.keys, []
    blobs = [st.store.get_blob(keys[0], reasons)] if len(keys) == 1 else st.store.batch_get(keys, reasons)
    return ops.GetAnswer(blobs, reasons if None in blobs else None)


def put(st: ServerState, req: ops.PutRequest) -> ops.PutAnswer:
    """Store every blob (the store verifies each one, CorruptBlob -> 422, and its size before it stores
    the first; it raises, 507, 503..., when no tier stored one: an answer says where each one is); then
    the keys they supersede go, now that every one of them is stored. Token hints (`token_ids`,
    `parents`: kvstore.token_hints) are checked first (InvalidArgument, 400, and nothing stored) and
    given to the server's KV events, if on, before the blobs are stored."""
    keys, blobs = req.keys, req.blobs
    note_hints(st.store, keys, blobs, req.token_ids, req.parents)
    if len(keys) == 1:
        stored_in = [st.store.put_blob(keys[0], blobs[0])]
    else:
        stored_in = st.store.batch_put(list(zip(keys, blobs, strict=True)))
    replaced = None
    if req.replaces:
        replaced = [k not in keys and _delete_superseded(st, k) for k in req.replaces]
    return ops.PutAnswer(len(keys), stored_in, replaced)


def _delete_superseded(st: ServerState, key: str) -> bool:
    """Whether `key` was stored and is gone; one a tier could not delete only takes room (the put it
    follows succeeded: its answer says so)."""
    try:
        return bool(st.store.delete(key))
    except KVStoreError as e:
        log.warning("a superseded chunk %s stays: %s", key, e)
        return False


def exists(st: ServerState, req: ops.KeysRequest) -> ops.ExistsAnswer:
    keys = req.keys
    found = [st.store.exists(keys[0])] if len(keys) == 1 else st.store.batch_exists(keys)
    return ops.ExistsAnswer([bool(f) for f in found])


def delete(st: ServerState, req: ops.KeysRequest) -> ops.DeleteAnswer:
    return ops.DeleteAnswer(each=[bool(st.store.delete(k)) for k in req.keys])


def lookup(st: ServerState, req: ops.LookupRequest) -> ops.LookupAnswer:
    """The number of leading keys that are stored (docs/design.md §1: the first gap ends the prefix),
    and why the next one is not (`miss`: not_stored, evicted, expired, corrupt, unreachable; None when
    all are). With `also`, whether each of those keys is stored too, in the same order: a client asks
    for a prefix and the candidates after it in one round trip."""
    n, reason = st.store.lookup(req.keys)
    st.metrics.count_lookup(n, len(req.keys))
    also = None if req.also is None else [bool(f) for f in st.store.batch_exists(req.also)]
    return ops.LookupAnswer(int(n), len(req.keys), reason, also)


HANDLERS = {ops.GET.name: get, ops.PUT.name: put, ops.EXISTS.name: exists, ops.DELETE.name: delete,
            ops.LOOKUP.name: lookup}  # fmt: skip
