"""How blobs travel on the data plane (kvstore.sdk.plane_transport): on its socket, in a same-host server's
shared memory, or read through its arena index. Each get answers (blobs, Loan | None): buffers the
caller owns (no Loan), or lent ones (`kvstore.sdk.buffers`) whose Loan gives them back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstore.sdk.backend import Outgoing
from kvstore.sdk.buffers import BufferPool, Free, Loan, fresh_buffer
from kvstore.sdk.dataplane import DataPlaneClient
from kvstore.sdk.shm import ClientArena, ClientSegment

from kvstore.blob import BlobHeader, PreparedBlob, copy_verified, verify_blob
from kvstore.errors import CorruptBlob, InvalidArgument
from kvstore.protocol import Blob, ops, shm
from kvstore.protocol import dataplane as dp

Got = tuple[list[Blob | None], Loan | None]
Intact = Callable[[], list[bool]]


class Receiver:
    """Where an answer's body lands: a fresh buffer the caller keeps (pool None), or pooled ones that
    are lent and come back to the pool with the Loan."""

    def __init__(self, pool: BufferPool | None) -> None:
        self.pool = pool
        self.frees: list[Free] = []

    def into(self, n: int) -> memoryview:
        if self.pool is None:
            return fresh_buffer(n)
        view, free = self.pool.take(n)
        self.frees.append(free)
        return view

    def abandon(self) -> None:
        """Give back every buffer taken so far (the answer is not used)."""
        for f in self.frees:
            f()
        self.frees = []

    def blobs(self, blobs: list[Blob | None], body: memoryview | None) -> Got:
        if self.pool is None:
            return blobs, None
        lent: list[Blob | None] = [None if b is None else memoryview(b).toreadonly() for b in blobs]
        views = [b for b in lent if isinstance(b, memoryview)] + ([body] if body is not None else [])
        frees = self.frees

        def free() -> None:
            for f in frees:
                f()

        return lent, Loan(views, free)

    def split(self, meta: dict, body: memoryview | None, n: int) -> Got:
        """The blobs of a data-plane answer carried on the socket, back to back in `body`."""
        lens = dp.meta_lens(meta, n, allow_missing=True)
        if dp.total(lens) != (0 if body is None else len(body)):
            raise InvalidArgument("the server's answer does not match the lengths it announced")
        blobs: list[Blob | None] = []
        pos = 0
        for length in lens:
            if length < 0:
                blobs.append(None)
                continue
            assert body is not None
            blobs.append(body if length == len(body) else body[pos : pos + length])
            pos += length
        return self.blobs(blobs, body)


def reasons_of(meta: dict, blobs: Sequence[Blob | None]) -> list[str | None]:
    """Why each miss of a data-plane get missed (None for hits; "not_stored" when the server did not say)."""
    given = meta.get("r")
    given = given if isinstance(given, list) and len(given) == len(blobs) else [None] * len(blobs)
    return [
        None if b is not None else (r if isinstance(r, str) else "not_stored")
        for b, r in zip(blobs, given, strict=True)
    ]


# -- the data plane -------------------------------------------------------------------------------------


_GET_WRITE = ops.writer(ops.GET.request, ops.PLANE)


def _get_meta(keys: list[str]) -> dict[str, Any]:
    return _GET_WRITE(ops.KeysRequest(keys))


def fetch_socket(plane: DataPlaneClient, keys: list[str], rx: Receiver) -> tuple[dict, Got]:
    _, meta, body = plane.call(dp.GET, _get_meta(keys), into=rx.into)
    return meta, rx.split(meta, body, len(keys))


def fetch_shm(
    plane: DataPlaneClient, seg: ClientSegment, keys: list[str], rx: Receiver, capacity: int
) -> tuple[dict, Got, bool] | None:
    """A get answered in shared memory when it can be: with blobs the server lends where they lie in
    its arena (when `seg` has it mapped), else written into a free region of `seg` when they fit in
    `capacity` (then True), else on the socket (False); None while the segment has no such region.
    Raises sdk.dataplane.SegmentGone when the server no longer knows `seg`."""
    capacity = min(seg.largest(), capacity)
    offset = seg.reserve(capacity) if capacity > 0 else None
    if offset is None:
        if seg.arena is None:
            return None
        offset, capacity = shm.DATA_START, 0  # no room for a copy, but lent blobs need none
    pins = seg.pins_to_give_back()
    try:
        meta_in = {**_get_meta(keys), "s": [seg.seg_id, offset, capacity], "u": pins}
        if seg.arena is not None:
            meta_in["a"] = seg.arena.nonce
        head, meta, body = plane.call(dp.GET, meta_in, flags=dp.FLAG_SHM, into=rx.into, segment=seg)
    except BaseException:
        seg.unpin.extend(pins)  # the server may not have seen them: again with the next request
        seg.free(offset, capacity)
        raise
    lens = dp.meta_lens(meta, len(keys), allow_missing=True)
    if head.flags & dp.FLAG_SHM and "a" in meta and seg.arena is not None:
        seg.free(offset, capacity)
        pin = meta.get("p")
        if type(pin) is not int:
            raise InvalidArgument("the server lent blobs without a pin")
        views = seg.arena.views(meta["a"], lens)
        return meta, _hand_over(views, lambda: seg.unpin.append(pin), rx), True
    if not head.flags & dp.FLAG_SHM or capacity == 0:  # did not fit: the answer came on the socket
        seg.free(offset, capacity)
        if head.flags & dp.FLAG_SHM:  # all misses, "written" into the empty region
            return meta, rx.blobs([None] * len(keys), None), True
        return meta, rx.split(meta, body, len(keys)), False
    used = dp.total(lens)
    if meta.get("o") != offset:
        raise InvalidArgument("the server wrote the answer elsewhere than asked")
    seg.allocator.shrink(offset, capacity, used)
    return meta, _hand_over(seg.views(offset, lens), lambda: seg.free(offset, used), rx), True


def fetch_index(
    arena: ClientArena, keys: list[str], rx: Receiver, lease_max: int = 1 << 62
) -> tuple[Got, list] | None:
    """Every blob of `keys` copied out of the server's arena where its index says it lies, without a
    request, and the headers of the copies; None when one is not in the index, its entry changed during
    the copy, or the server's heartbeat is stale (the caller then asks the server). A whole copy is the
    blob the server verified and stored (a region is never reused while an entry names it); a lease's
    copies (pooled buffers) are verified too, in the same pass (headers None for the others). A lease
    of more than `lease_max` bytes is None too: lent where they lie, such blobs need no copy at all."""
    index = arena.index
    assert index is not None
    found = index.find_all(keys)
    if found is None:
        return None
    if rx.pool is not None and sum(n for *_, n in found) > lease_max:
        return None
    blobs: list[Blob | None] = []
    headers: list[BlobHeader | None] = []
    for key, (slot, gen, offset, n) in zip(keys, found, strict=True):
        buf = rx.into(n)
        src = arena.view[offset : offset + n]
        try:
            if rx.pool is None:
                buf[:] = src
                headers.append(None)
            else:
                headers.append(copy_verified(src, buf, key=key))
        except CorruptBlob:  # torn (the check below says so) or spoiled: the server decides
            gen = -1
        if not index.unchanged(slot, gen):  # replaced or evicted meanwhile: the copy may be torn
            rx.abandon()
            return None
        blobs.append(buf)
    return rx.blobs(blobs, None), headers


def lend_index(
    arena: ClientArena, keys: list[str]
) -> tuple[list[Blob | None], list[BlobHeader], Loan, Intact] | None:
    """Every blob of `keys` where it lies in the server's arena, found by its index: no request, no
    copy; their headers; and the check that says, per blob, whether it is still whole. None when one
    is not in the index, or its header does not parse, or the server's heartbeat is stale (the caller
    then asks the server).

    The arena is the server's cpu tier, which holds only blobs it verified (a trusted tier, design §3)
    and no client can write (sealed): the headers are parsed, the checksums not recomputed. Nothing
    stops the server from reusing a region once it has withdrawn its entry, so this is the seqlock read
    of `fetch_index` stretched over the caller's use: the caller uses the views, then asks `intact()`
    and throws away what it made of a blob that is not whole."""
    index = arena.index
    assert index is not None
    found = index.find_all(keys)
    if found is None:
        return None
    views: list[Blob | None] = [arena.view[offset : offset + n] for _, _, offset, n in found]
    try:
        headers = [verify_blob(v, checksum=False, key=k) for k, v in zip(keys, views, strict=True)]
    except CorruptBlob:  # a region reused under the entry just now (or a bug): the server decides
        return None

    def intact() -> list[bool]:
        return [index.unchanged(slot, gen) for slot, gen, _, _ in found]

    return views, headers, Loan([v for v in views if v is not None], lambda: None), intact


def _hand_over(views: list[memoryview | None], done: Free, rx: Receiver) -> Got:
    """Blobs in shared memory (the client's region, or the server's arena): lent to the caller until
    the lease ends, then `done` (the region freed, the pin given back); or copied into buffers the
    caller owns, and `done` at once."""
    if rx.pool is not None:
        return list(views), Loan([v for v in views if v is not None], done)
    owned: list[Blob | None] = [None if v is None else bytes(v) for v in views]
    for v in views:
        if v is not None:
            v.release()
    done()
    return owned, None


def put_shm(plane: DataPlaneClient, seg: ClientSegment, meta: dict, blobs: Sequence[Outgoing]) -> dict | None:
    """A put (`meta`: its request, kvstore.protocol.ops.PUT) through a free region of `seg` (None while
    there is none): each blob written into it once (a PreparedBlob laid out there, not copied from a
    blob laid out first); the server's answer."""
    total = sum(meta["l"])
    offset = seg.reserve(total)
    if offset is None:
        return None
    pins = seg.pins_to_give_back()
    try:
        seg.write(offset, blobs)
        return plane.call(dp.PUT, {**meta, "s": [seg.seg_id, offset, total], "u": pins}, flags=dp.FLAG_SHM,
                          segment=seg)[1]  # fmt: skip
    except BaseException:
        seg.unpin.extend(pins)
        raise
    finally:
        seg.free(offset, total)


def put_socket(plane: DataPlaneClient, meta: dict, blobs: Sequence[Outgoing]) -> dict:
    """A put with the blobs on the socket; the server's answer."""
    return plane.call(dp.PUT, meta, body_of(blobs))[1]


def nbytes(blob: Outgoing) -> int:
    return blob.nbytes if isinstance(blob, PreparedBlob) else memoryview(blob).nbytes


def body_of(blobs: Sequence[Outgoing]) -> list[Blob]:
    """The blobs as buffers to send back to back: a PreparedBlob as its header and payload, unjoined."""
    out: list[Blob] = []
    for b in blobs:
        if isinstance(b, PreparedBlob):
            out.extend(b.parts())
        else:
            out.append(b)
    return out
