"""The router's KV-event feed: one SUB socket per publisher (engines and stores), checked frame by frame,
kept in step with each publisher's replay buffer.

Every frame is validated before anything is applied: three frames (topic, seq, payload), the topic
exactly the configured one, the seq exactly 8 bytes and at most 2^63 - 1 (vLLM counts from 0, one a
batch), no frame over `max_frame_bytes` (ZMQ_MAXMSGSIZE: a publisher that sends one is disconnected
before it is read, then reconnected). A frame that fails is dropped and counted in its source's
`malformed`; nothing else stops, and nothing that goes wrong with one source ends the thread.

Sequence: a batch whose seq is the last applied + 1 is applied. Anything else is checked against the
publisher's replay buffer (`replay_endpoint`), anchored at the last applied seq:

- the replay's first batch is that seq with the very payload applied (a digest is kept of the last
  DIGESTS applied batches): the same stream; what follows fills the gap, contiguously;
- otherwise the publisher restarted (its seq began again at 0, its first batches lost to ZMQ's slow
  joiner) or its buffer no longer reaches our last batch: what the router indexed from it is forgotten
  and it is replayed from 0.

A live batch the replay does not confirm (a seq it does not reach, another payload at that seq) is not
applied: it is counted in `untrusted`. After a SUB's connection drops (a restarting publisher's does),
the check once it is up again starts from the last batch applied before the drop: every batch applied
since must be in the replay, byte for byte, so a restarted publisher whose first batch seen happens to
carry the next seq is still noticed. The SUB is then opened anew (libzmq does not reconnect one whose
publisher sent a frame over the limit). A source without a replay endpoint cannot check: a gap is
counted in `lost` and the batch applied; a seq at or below the last (another payload) means a restart:
its index is reset and the batch applied. Every `check_s` (doubling up to 60 s while it does not answer)
each source's replay is asked again from the last seq: a restarted publisher that has published
nothing the router saw is still noticed, and a last batch lost to the high-water mark is recovered.

Authentication (`Source.server_key`): the SUB and replay sockets are CURVE clients of that publisher
key (kvstore.events.curve_server_key of the publisher's token): a peer that does not hold the token
cannot complete the handshake, so nothing it sends is read.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.events import END_SEQ, MAX_SEQ, all_blocks_cleared, decode_batch

logger = logging.getLogger(__name__)
REPLAY_TIMEOUT_S = 2.0  # a replay that sends nothing this long has failed
REPLAY_TOTAL_S = 30.0  # and one that goes on longer is cut off (what it gave so far is kept)
RESYNC_MIN_S = 0.2  # between two replays of one source asked for by live batches
CHECK_MAX_S = 60.0  # the longest wait between two checks of a publisher that does not answer
REOPEN_MIN_S, REOPEN_MAX_S = 0.1, 5.0  # a SUB opened anew after a disconnection: doubling while it recurs
DIGESTS = 8192  # applied batches per source whose digest is kept (duplicates are recognised by it)
MAX_FRAME_BYTES = 4 << 20  # a batch is KiBs (a server's snapshot batch ~20 KiB, a 64k-token step ~200 KiB)


@dataclass
class FeedOptions:
    """How the router reads KV events (RouterConfig.events; `kvstore-engine router` flags)."""

    engine_token: str | None = field(default=None, repr=False)  # the engines' events token (CURVE)
    store_token: str | None = field(default=None, repr=False)  # the stores' events token (CURVE)
    max_frame_bytes: int = MAX_FRAME_BYTES  # a larger frame disconnects its publisher
    max_engine_blocks: int = 262_144  # blocks indexed per engine (the oldest go first)
    max_store_keys: int = 1_048_576  # chunk keys indexed per store
    check_s: float = 5.0  # between checks of each publisher's replay (0: never)

    def __post_init__(self) -> None:
        if self.max_frame_bytes < 1024 or self.max_engine_blocks < 1 or self.max_store_keys < 1:
            raise ValueError("events: max frame >= 1 KiB, index caps >= 1")
        if self.check_s < 0:
            raise ValueError("events: the check interval must be >= 0")


@dataclass
class Source:
    name: str
    endpoint: str
    replay_endpoint: str | None
    apply: Callable[[str, list[Any]], None]  # (source name, events)
    topic: str = ""
    server_key: bytes | str | None = field(default=None, repr=False)  # the publisher's CURVE key (Z85)
    last_seq: int = -1
    batches: int = 0  # applied
    replayed: int = 0  # of those, from the replay endpoint
    malformed: int = 0  # frames dropped: shape, topic, seq, size of answer, undecodable payload
    untrusted: int = 0  # live batches the publisher's replay did not confirm (not applied)
    resyncs: int = 0  # restarts seen: its index reset, replayed from 0
    lost: int = 0  # batches skipped by a gap no replay could fill (no replay endpoint)
    errors: int = 0  # exceptions while handling its frames (logged)
    applied: dict[int, int] = field(default_factory=dict, repr=False)  # seq -> digest, the last DIGESTS
    next_check: float = 0.0  # monotonic
    check_wait: float = 0.0
    reopen_at: float = float("inf")  # monotonic: when its SUB is opened anew (after a disconnection)
    reopen_wait: float = 0.0
    reopened_at: float = float("-inf")
    verify_from: int | None = None  # the last seq applied before a disconnection: checked from there
    reconnects: int = 0
    resync_after: float = 0.0  # monotonic: no replay for a live batch before

    def state(self) -> dict[str, Any]:
        """For /v1/router/state."""
        keys = ("last_seq", "batches", "replayed", "malformed", "untrusted", "resyncs", "lost", "errors",
                "reconnects")  # fmt: skip
        return {k: getattr(self, k) for k in keys}


def _digest(payload: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big")


class EventSubscriber:
    def __init__(self, sources: list[Source], options: FeedOptions | None = None) -> None:
        import zmq

        self._zmq = zmq
        self.sources = sources
        self.options = options or FeedOptions()
        self._ctx = zmq.Context.instance()
        self._socks: dict[Any, Source] = {}  # SUB -> its source
        self._monitors: dict[Any, Source] = {}  # the SUB's monitor -> its source
        self._subs: dict[int, tuple[Any, Any]] = {}  # id(source) -> (SUB, monitor)
        self._poller: Any = None
        self._client_keys = zmq.curve_keypair() if any(s.server_key for s in sources) else None
        self._running = True
        self.ready = threading.Event()  # set once every source was asked for its replay
        self._thread = threading.Thread(target=self._run, name="router-events", daemon=True)
        self._topics = {id(s): s.topic.encode() for s in sources}

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """False when the events thread has ended while it should run: then nothing is followed."""
        return self._thread.is_alive() or self._thread.ident is None or not self._running

    # ---- sockets -------------------------------------------------------------------------------------
    def _socket(self, kind: int, src: Source) -> Any:
        zmq = self._zmq
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.options.max_frame_bytes)
        if src.server_key:
            assert self._client_keys is not None
            key = src.server_key.encode() if isinstance(src.server_key, str) else src.server_key
            sock.curve_serverkey = key
            sock.curve_publickey, sock.curve_secretkey = self._client_keys
        return sock

    def _recv(self, sock: Any) -> list[bytes]:
        """One message's frames; past five the rest are read and dropped (the message is malformed)."""
        frames = [sock.recv()]
        while sock.rcvmore:
            frame = sock.recv()
            if len(frames) < 5:
                frames.append(frame)
        return frames

    def _parse(self, src: Source, frames: list[bytes]) -> tuple[int, bytes] | None:
        """(seq, payload) of a well-formed (topic, seq, payload) message, else None (counted)."""
        if len(frames) == 3 and frames[0] == self._topics[id(src)] and len(frames[1]) == 8:
            seq = int.from_bytes(frames[1], "big")
            if seq <= MAX_SEQ:
                return seq, frames[2]
        self._malformed(src, f"a message of {len(frames)} frame(s) not in vLLM's shape or topic")
        return None

    def _malformed(self, src: Source, what: str) -> None:
        src.malformed += 1
        if src.malformed & (src.malformed - 1) == 0:  # 1, 2, 4, 8...: a hostile peer cannot fill the log
            logger.warning(
                "KV events from %s: %s dropped (%d malformed so far)", src.name, what, src.malformed
            )

    # ---- applying --------------------------------------------------------------------------------------
    def _apply(self, src: Source, seq: int, payload: bytes, digest: int | None = None) -> None:
        """Apply the batch at `seq`, which follows the last applied (or starts a stream)."""
        src.last_seq = seq
        src.applied[seq] = _digest(payload) if digest is None else digest
        while len(src.applied) > DIGESTS:
            del src.applied[next(iter(src.applied))]
        try:
            batch = decode_batch(payload)
        except Exception as e:  # msgspec.DecodeError and friends: its seq is used up, the stream goes on
            self._malformed(src, f"undecodable batch {seq} ({e})")
            return
        src.batches += 1
        src.apply(src.name, batch.events)

    def _reset(self, src: Source, why: str) -> None:
        """Forget what `src` announced: its index and seq (a restarted publisher starts again)."""
        logger.warning(
            "KV events from %s: %s; forgetting what it announced and replaying it from 0", src.name, why
        )
        src.apply(src.name, [all_blocks_cleared()])
        src.last_seq = -1
        src.applied.clear()
        src.verify_from = None
        src.resyncs += 1

    def _handle(self, src: Source, frames: list[bytes]) -> None:
        parsed = self._parse(src, frames)
        if parsed is None:
            return
        seq, payload = parsed
        if seq == src.last_seq + 1:
            self._apply(src, seq, payload)
            return
        digest = _digest(payload)
        if seq <= src.last_seq and src.applied.get(seq) == digest:
            return  # a duplicate: the replay gave it first
        if not src.replay_endpoint:  # nothing to check against: follow the publisher
            if seq <= src.last_seq:
                self._reset(src, f"its seq went back from {src.last_seq} to {seq}")
            elif src.last_seq >= 0:
                src.lost += seq - src.last_seq - 1
            self._apply(src, seq, payload, digest)
            return
        now = time.monotonic()
        if now < src.resync_after:  # replayed very recently: drop it, a check comes soon
            src.next_check = min(src.next_check, src.resync_after)
            return
        self._resync(src)
        if src.applied.get(seq) != digest:
            src.untrusted += 1
            if src.untrusted & (src.untrusted - 1) == 0:
                logger.warning("KV events from %s: batch %d not confirmed by its replay, dropped (%d so far)",
                               src.name, seq, src.untrusted)  # fmt: skip

    def _resync(self, src: Source) -> bool:
        """Bring `src` in step with its replay buffer (module docstring). False if the replay failed."""
        src.resync_after = time.monotonic() + RESYNC_MIN_S
        anchor = src.verify_from if src.verify_from in src.applied else src.last_seq
        if anchor is not None and anchor >= 0:
            first: list[int] = []
            differs: list[int] = []

            def follow(seq: int, payload: bytes) -> bool:
                if not first:
                    first.append(seq)
                if seq <= src.last_seq:  # the anchor, and what was applied after it: the very same batches?
                    known = src.applied.get(seq)
                    if (seq == anchor and known is None) or (known is not None and known != _digest(payload)):
                        differs.append(seq)
                        return False
                    return True
                self._apply(src, seq, payload)
                src.replayed += 1
                return True

            done = self._replay(src, anchor, follow)
            if done is None and not differs:
                return False
            if not differs and first and first[0] == anchor:
                src.verify_from = None
                return True
            why = f"batch {differs[0]} differs" if differs else f"batch {anchor} is no longer there"
            self._reset(src, f"its replay does not continue what was applied ({why})")

        def take(seq: int, payload: bytes) -> bool:
            self._apply(src, seq, payload)
            src.replayed += 1
            return True

        return self._replay(src, 0, take) is not None

    def _replay(self, src: Source, start: int, take: Callable[[int, bytes], bool]) -> bool | None:
        """Ask src's replay endpoint for every batch from `start`; each well-formed one, in order and
        contiguous, goes to `take` until it returns False. True: the end marker came; False: `take`
        stopped; None: no answer in time, or a malformed one (what came before it was taken)."""
        zmq = self._zmq
        sock = self._socket(zmq.DEALER, src)
        sock.connect(src.replay_endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            began = idle = time.monotonic()
            prev = None
            while True:
                now = time.monotonic()
                if now - idle > REPLAY_TIMEOUT_S or now - began > REPLAY_TOTAL_S:
                    hint = " (CURVE: the publisher's token?)" if src.server_key else ""
                    logger.warning("KV events: no (whole) replay from %s within %g s%s", src.replay_endpoint,
                                   REPLAY_TIMEOUT_S if now - idle > REPLAY_TIMEOUT_S else REPLAY_TOTAL_S, hint)  # fmt: skip
                    return None
                if not sock.poll(50):
                    continue
                idle = time.monotonic()
                frames = self._recv(sock)
                if len(frames) == 4 and frames[0] == b"" and frames[2] == END_SEQ:
                    return True
                parsed = self._parse(src, frames[1:]) if len(frames) == 4 and frames[0] == b"" else None
                if parsed is None:
                    if len(frames) != 4 or frames[0] != b"":
                        self._malformed(src, "a replay answer not in vLLM's shape")
                    return None
                seq, payload = parsed
                if seq < start or (prev is not None and seq != prev + 1):
                    self._malformed(src, f"replayed batch {seq} out of order (after {prev}, from {start})")
                    return None
                prev = seq
                if not take(seq, payload):
                    return False
        finally:
            sock.close()

    # ---- the thread -----------------------------------------------------------------------------------
    def _open(self, src: Source) -> None:
        """The source's SUB (and its monitor), connected, in the poller."""
        zmq = self._zmq
        sock = self._socket(zmq.SUB, src)
        sock.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(src.endpoint)
        self._socks[sock], self._monitors[monitor], self._subs[id(src)] = src, src, (sock, monitor)
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def _close(self, src: Source) -> None:
        sock, monitor = self._subs.pop(id(src))
        for s in (sock, monitor):
            self._poller.unregister(s)
        del self._socks[sock], self._monitors[monitor]
        sock.disable_monitor()
        monitor.close()
        sock.close()

    def _on_monitor(self, src: Source, monitor: Any) -> None:
        """A SUB's connection went down or came up: a publisher may have restarted meanwhile. What was
        applied since the last batch before the disconnection is checked against its replay, once it is
        up again. The SUB is opened anew after a disconnection: libzmq does not reconnect one whose
        publisher broke the protocol (a frame over ZMQ_MAXMSGSIZE)."""
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)["event"]
        now = time.monotonic()
        if event == self._zmq.EVENT_DISCONNECTED:
            src.reconnects += 1
            if src.verify_from is None and src.last_seq >= 0:
                src.verify_from = src.last_seq
            recent = now - src.reopened_at < REOPEN_MAX_S
            src.reopen_wait = min(REOPEN_MAX_S, src.reopen_wait * 2) if recent else REOPEN_MIN_S
            src.reopen_at = now + src.reopen_wait
        elif event == self._zmq.EVENT_HANDSHAKE_SUCCEEDED and src.replay_endpoint:
            src.next_check = min(src.next_check, now)

    def _check(self, src: Source) -> None:
        """The periodic replay of one source, backing off while it does not answer."""
        ok = self._resync(src)
        base = self.options.check_s
        if ok:
            src.check_wait = base
            src.next_check = time.monotonic() + base if base > 0 else float("inf")
        else:
            src.check_wait = min(CHECK_MAX_S, max(base or 1.0, src.check_wait * 2))
            src.next_check = time.monotonic() + src.check_wait

    def _error(self, src: Source, what: str) -> None:
        """An exception while serving `src`: counted, logged with its traceback (1st, 2nd, 4th, 8th...)."""
        src.errors += 1
        if src.errors & (src.errors - 1) == 0:
            logger.exception("KV events from %s: %s failed (%d errors so far)", src.name, what, src.errors)

    def _tick(self, src: Source, now: float) -> None:
        """The source's timers: a SUB to open anew, a replay check due."""
        if now >= src.reopen_at and id(src) in self._subs:
            src.reopen_at, src.reopened_at = float("inf"), now
            self._close(src)
            self._open(src)
        if src.replay_endpoint and now >= src.next_check:
            self._check(src)

    def _run(self) -> None:
        zmq = self._zmq
        self._poller = zmq.Poller()
        for src in self.sources:
            try:
                self._open(src)
            except zmq.ZMQError as e:  # a bad endpoint: that source is not followed, the others are
                src.errors += 1
                logger.error("KV events from %s: cannot subscribe to %s: %s", src.name, src.endpoint, e)
        for src in self.sources:  # live batches queue in the SUB sockets meanwhile
            if src.replay_endpoint:
                try:
                    self._check(src)
                except Exception:
                    self._error(src, "the first replay")
        self.ready.set()
        try:
            while self._running:
                for sock, _ in self._poller.poll(100):
                    if sock in self._monitors:
                        self._on_monitor(self._monitors[sock], sock)
                        continue
                    src = self._socks.get(sock)
                    if src is None:
                        continue
                    try:
                        self._handle(src, self._recv(sock))
                    except Exception:  # one source's trouble must not stop the others
                        self._error(src, "handling a batch")
                now = time.monotonic()
                for src in self.sources:
                    try:
                        self._tick(src, now)
                    except Exception:
                        src.next_check, src.reopen_at = now + CHECK_MAX_S, float("inf")
                        self._error(src, "checking its replay")
        finally:
            for src in self.sources:
                if id(src) in self._subs:
                    self._close(src)

    def stop(self) -> None:
        self._running = False
        self._thread.join(2)


class FeedCollector:
    """`kvstore_router_events_*` and `kvstore_router_index_*` per source, read at each scrape (register
    it on the router's prometheus registry)."""

    def __init__(self, subscriber: EventSubscriber, index: Any) -> None:
        self.subscriber, self.index = subscriber, index

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counters = {
            "batches": "KV event batches applied",
            "malformed": "KV event frames dropped as malformed (shape, topic, seq, size, undecodable)",
            "untrusted": "live KV event batches the publisher's replay did not confirm (not applied)",
            "resyncs": "publisher restarts seen: the source's index reset and replayed from 0",
            "lost": "KV event batches skipped by a gap no replay could fill",
            "errors": "exceptions while handling a source's KV events",
        }
        for name, doc in counters.items():
            family = CounterMetricFamily(f"kvstore_router_events_{name}", doc, labels=["source"])
            for s in self.subscriber.sources:
                family.add_metric([s.name], getattr(s, name))
            yield family
        seq = GaugeMetricFamily(
            "kvstore_router_events_last_seq", "last KV event seq applied", labels=["source"]
        )
        for s in self.subscriber.sources:
            seq.add_metric([s.name], s.last_seq)
        yield seq
        yield GaugeMetricFamily(
            "kvstore_router_events_up",
            "1 while the router's KV events thread runs",
            value=self.subscriber.alive,
        )
        sizes = self.index.sizes()
        entries = GaugeMetricFamily(
            "kvstore_router_index_entries",
            "blocks (engines) or chunk keys (stores) indexed",
            labels=["source"],
        )
        evicted = CounterMetricFamily(
            "kvstore_router_index_evicted",
            "index entries dropped by its cap, oldest first",
            labels=["source"],
        )
        for name, (n, gone) in sizes.items():
            entries.add_metric([name], n)
            evicted.add_metric([name], gone)
        yield entries
        yield evicted
