"""KV events in vLLM's own wire format (`vllm.distributed.kv_events`), published by the engine and the
server so that vLLM's decoder, Dynamo, llm-d and `kvstore-engine router` read them unchanged.

Wire: a ZMQ PUB socket sends three frames per batch, `(topic, seq as 8-byte big-endian, payload)`,
where the payload is a msgpack `KVEventBatch` — an array `[ts, events, data_parallel_rank]` whose
events are maps tagged by `type` ("BlockStored", "BlockRemoved", "AllBlocksCleared"). A ROUTER socket
on `replay_endpoint` answers a request frame holding a start seq (8-byte big-endian) with every buffered
batch from that seq on, as `(empty, topic, seq, payload)`, then `(empty, b"", seq -1, b"")`. The last
`buffer_steps` batches are kept for replay; the queue to the publishing thread is bounded
(`max_queue_size`: beyond it a batch is dropped and counted, never blocking the engine step or a put).

`medium` names where a block lives: "GPU" for an engine's own KV cache (vLLM's name for it, on CPU too),
and a kvstore-server's tiers "GPU" / "CPU" / "STORAGE" (disk) / "REDIS" (Redis or Valkey, standalone or
Cluster). A server's `block_hashes` are its chunk keys as 16+ raw bytes (`bytes.fromhex(key)`); an
engine's are its block hashes (kvstore.keys.hash_block chained from its root) with
`parent_block_hash` None for a prompt's first block, as vLLM does.

Endpoints behave as vLLM's: one with `*`, `::`, or `ipc://` / `inproc://` is bound, any other is
connected to; the replay endpoint is always bound. pyzmq and msgspec come with vLLM; they are imported
only when events are enabled.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from itertools import count
from typing import Any

from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
MEDIUM_REDIS = "REDIS"
TIER_MEDIUM = {"gpu": MEDIUM_GPU, "cpu": MEDIUM_CPU, "disk": MEDIUM_STORAGE, "redis": MEDIUM_REDIS}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field (`--kv-events-config` takes it as JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_kv_events_config(value: str | Mapping[str, Any] | KVEventsConfig | None) -> KVEventsConfig:
    """A KVEventsConfig from JSON text or a mapping (None: disabled); ConfigError names what is wrong."""
    if value is None or isinstance(value, KVEventsConfig):
        return value or KVEventsConfig()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ConfigError("--kv-events-config must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}")
    config = KVEventsConfig(**value)
    if config.publisher not in (None, "zmq", "null"):
        raise ConfigError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {config.publisher!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
            raise ConfigError(f"--kv-events-config: {name} must be a positive integer")
    return config


_STRUCTS: dict[str, Any] = {}


def structs() -> dict[str, Any]:
    """{"KVEventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared"} -> msgspec class."""
    if not _STRUCTS:
        from kvstore import event_types as t  # noqa: PLC0415 (needs msgspec: only with events on)

        _STRUCTS.update(
            {c.__name__: c for c in (t.KVEventBatch, t.BlockStored, t.BlockRemoved, t.AllBlocksCleared)}
        )
    return _STRUCTS


def block_stored(
    hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int, medium: str
) -> Any:
    return structs()["BlockStored"](
        block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids, block_size=block_size,
        lora_id=None, medium=medium, lora_name=None,
    )  # fmt: skip


def block_removed(hashes: list[bytes], medium: str) -> Any:
    return structs()["BlockRemoved"](block_hashes=hashes, medium=medium)


def all_blocks_cleared() -> Any:
    return structs()["AllBlocksCleared"]()


def decode_batch(payload: bytes) -> Any:
    """A KVEventBatch from a PUB/replay payload (msgspec.DecodeError on bad bytes)."""
    import msgspec

    return msgspec.msgpack.decode(payload, type=structs()["KVEventBatch"])


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB + ROUTER replay, from one thread; `publish` only enqueues (bounded, never blocks)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        try:
            import zmq
        except ImportError as e:
            raise ConfigError(f"KV events need pyzmq and msgspec (they come with vLLM): {e}") from None
        self.config = config
        self.dp_rank = data_parallel_rank
        self.published = 0
        self.dropped = 0  # batches the full queue refused
        self._queue: queue.Queue[list[Any] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if _is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(
                f"KV events: cannot open {config.endpoint} / {config.replay_endpoint}: {e}"
            ) from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Any]) -> None:
        """Queue one batch; dropped (and counted) when the queue is full or the publisher closed."""
        if not events or not self._running:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        import msgspec

        encoder = msgspec.msgpack.Encoder()
        batch_cls = structs()["KVEventBatch"]
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if events is None:
                break
            seq = next(self._seq)
            payload = encoder.encode(
                batch_cls(ts=time.time(), events=events, data_parallel_rank=self.dp_rank)
            )
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # a ZMQ failure must not end the thread: the batch stays replayable
                logger.exception("KV events: publishing batch %d failed", seq)
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Publish what is queued (up to `timeout_s`), then close. Idempotent."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()


def make_publisher(value: str | Mapping[str, Any] | KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher `--kv-events-config` asks for, or None when events are off (the default)."""
    config = parse_kv_events_config(value)
    return ZmqEventPublisher(config) if config.enabled else None


class StoreEvents:
    """A tiered store's KV events: each tier is a medium (TIER_MEDIUM), each chunk key a block hash.

    Attached as the store's `metrics.events` sink (kvstore.tier_calls reports every put's stored and
    evicted keys and every delete that removed a key, per tier). The first batch is AllBlocksCleared
    followed by what the local tiers already hold (a disk tier after a warm restart), so a subscriber,
    or a router replaying, starts from the truth. A server does not know a chunk's tokens: its
    BlockStored events have no token_ids, no parent and block_size 0. Not seen: TTL expiry (a tier
    drops an expired blob lazily) and evictions Redis makes on its own (maxmemory).
    """

    SNAPSHOT_BATCH = 1024  # keys per BlockStored of the start-up snapshot

    def __init__(self, store: Any, config: KVEventsConfig) -> None:
        self.publisher = ZmqEventPublisher(config)
        self.publisher.publish([all_blocks_cleared()])
        for tier in store.tiers:
            if tier.name == "redis":  # shared by many servers and possibly huge: not listed
                continue
            keys = list(tier.keys())
            for i in range(0, len(keys), self.SNAPSHOT_BATCH):
                self.publisher.publish([self._stored(tier.name, keys[i : i + self.SNAPSHOT_BATCH])])
        self.store = store
        store.metrics.events = self

    @classmethod
    def attach(cls, store: Any, value: str | Mapping[str, Any] | None) -> StoreEvents | None:
        config = parse_kv_events_config(value)
        return cls(store, config) if config.enabled else None

    @staticmethod
    def _stored(tier: str, keys: list[str]) -> Any:
        medium = TIER_MEDIUM.get(tier, tier.upper())
        return block_stored([bytes.fromhex(k) for k in keys], None, [], 0, medium)

    def __call__(self, tier: str, stored: list[str], removed: list[str]) -> None:
        events = []
        if removed:
            events.append(
                block_removed([bytes.fromhex(k) for k in removed], TIER_MEDIUM.get(tier, tier.upper()))
            )
        if stored:
            events.append(self._stored(tier, stored))
        self.publisher.publish(events)

    def shutdown(self) -> None:
        """Detach from the store (which may outlive the server) and close the sockets."""
        if self.store.metrics.events is self:
            self.store.metrics.events = None
        self.publisher.shutdown()
