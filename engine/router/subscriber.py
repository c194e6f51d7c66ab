"""The router's KV-event feed: one SUB socket per publisher (engines and stores), replayed from seq 0 on
start (a restarted router rebuilds its index from the publishers' replay buffers) and again from the
last seq seen whenever a gap shows (a batch lost to the PUB high-water mark or a slow join).

A batch whose seq is not above the last one seen is a duplicate, unless it starts with
AllBlocksCleared: then the publisher restarted (its seq starts again at 0) and the stream is new.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.events import END_SEQ, decode_batch

logger = logging.getLogger(__name__)
REPLAY_TIMEOUT_S = 2.0


@dataclass
class Source:
    name: str
    endpoint: str
    replay_endpoint: str | None
    apply: Callable[[str, list[Any]], None]  # (source name, events)
    topic: str = ""
    last_seq: int = -1
    batches: int = 0
    replayed: int = 0


class EventSubscriber:
    def __init__(self, sources: list[Source]) -> None:
        import zmq

        self._zmq = zmq
        self.sources = sources
        self._ctx = zmq.Context.instance()
        self._socks: dict[Any, Source] = {}
        self._running = True
        self.ready = threading.Event()  # set once every source was asked for its replay
        self._thread = threading.Thread(target=self._run, name="router-events", daemon=True)

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    def _handle(self, src: Source, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except Exception as e:  # msgspec.DecodeError and friends: one bad batch, not a dead feed
            logger.warning("KV events from %s: undecodable batch %d (%s)", src.name, seq, e)
            return
        restart = bool(batch.events) and type(batch.events[0]).__name__ == "AllBlocksCleared"
        if seq <= src.last_seq and not restart:
            return
        if seq > src.last_seq + 1 and src.last_seq >= 0 and not restart:
            self._replay(src, src.last_seq + 1)  # fills the gap, then this batch is a duplicate
            if seq <= src.last_seq:
                return
        src.last_seq = seq
        src.batches += 1
        src.apply(src.name, batch.events)

    def _replay(self, src: Source, start: int) -> None:
        if not src.replay_endpoint:
            return
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(src.replay_endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while time.monotonic() < deadline:
                if not sock.poll(50):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                src.replayed += 1
                self._handle_replayed(src, int.from_bytes(frames[2], "big"), frames[3])
            logger.warning("KV events: no replay from %s within %g s", src.replay_endpoint, REPLAY_TIMEOUT_S)
        finally:
            sock.close()

    def _handle_replayed(self, src: Source, seq: int, payload: bytes) -> None:
        if seq > src.last_seq:
            try:
                batch = decode_batch(payload)
            except Exception as e:  # msgspec.DecodeError and friends: skip the batch, keep the feed
                logger.warning("KV events from %s: undecodable replayed batch %d (%s)", src.name, seq, e)
                return
            src.last_seq = seq
            src.batches += 1
            src.apply(src.name, batch.events)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        for src in self.sources:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
            sock.connect(src.endpoint)
            self._socks[sock] = src
            poller.register(sock, zmq.POLLIN)
        for src in self.sources:  # live batches queue in the SUB sockets meanwhile
            self._replay(src, 0)
        self.ready.set()
        try:
            while self._running:
                for sock, _ in poller.poll(100):
                    frames = sock.recv_multipart()
                    if len(frames) == 3:
                        self._handle(self._socks[sock], int.from_bytes(frames[1], "big"), frames[2])
        finally:
            for sock in self._socks:
                sock.close()

    def stop(self) -> None:
        self._running = False
        self._thread.join(2)
