"""The router's KV-event feed against garbled, forged and restarted publishers (issue 45 items 4, 5, 6,
10): a bad frame is dropped and counted and stops nothing; a forged seq or replay answer is not
believed; a restarted publisher is noticed and replayed from 0; frames over the limit are never read;
the index is bounded; a router given a publisher's token reads only that publisher."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq
from kvstore.engine.router import subscriber as subscriber_mod
from kvstore.engine.router.index import PrefixIndex
from kvstore.engine.router.subscriber import EventSubscriber, Source

from kvstore.events import (
    KVEventsConfig,
    ZmqEventPublisher,
    all_blocks_cleared,
    block_stored,
    structs,
)
from tests.router.events_util import settle
from tests.waiting import wait_until

ENCODER = msgspec.msgpack.Encoder()


def payload(events: list) -> bytes:
    return ENCODER.encode(structs()["KVEventBatch"](ts=time.time(), events=events, data_parallel_rank=0))


def blocks(first: int, n: int, parent: bytes | None = None) -> list:
    """n chained 4-token blocks whose hashes and tokens start at `first` (block k: tokens 4k..4k+3)."""
    out, p = [], parent
    for k in range(first, first + n):
        h = k.to_bytes(16, "big")
        out.append(block_stored([h], p, list(range(4 * k, 4 * k + 4)), 4, "GPU"))
        p = h
    return out


def prompt(first: int, n: int) -> list[int]:
    return list(range(4 * first, 4 * (first + n))) + [99_999]


class RawPublisher:
    """vLLM's protocol spoken by hand (a PUB, and a ROUTER answering replays from a buffer) so that a
    test can also put garbled or forged frames on the wire, or forge the next replay answer."""

    def __init__(self, tmp: Path, name: str, topic: bytes = b"") -> None:
        ctx = zmq.Context.instance()
        self.endpoint, self.replay_endpoint = f"ipc://{tmp}/{name}-pub", f"ipc://{tmp}/{name}-replay"
        self.topic = topic
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.forged_answer: list[tuple[bytes, bytes]] | None = None  # (seq frame, payload), once
        self._stop = threading.Event()
        self._rep = ctx.socket(zmq.ROUTER)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(self.replay_endpoint)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._rep.poll(20):
                continue
            client, _, start = self._rep.recv_multipart()
            forged, self.forged_answer = self.forged_answer, None
            if forged is not None:
                answer = [(s, p) for s, p in forged]
            else:
                first = int.from_bytes(start, "big")
                answer = [(s.to_bytes(8, "big"), p) for s, p in list(self.buffer) if s >= first]
            for seq, data in answer:
                self._rep.send_multipart((client, b"", self.topic, seq, data))
            self._rep.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def publish(self, events: list) -> int:
        seq, data = self.seq, payload(events)
        self.seq += 1
        self.buffer.append((seq, data))
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), data))
        return seq

    def send_raw(self, *frames: bytes) -> None:
        self.pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._rep.close()
        self.pub.close()


def until(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "the router's index") -> None:
    wait_until(cond, timeout_s, 0.02, what=f"{what} getting there")


@pytest.fixture
def feed():
    """feed(sources, **options) -> a started EventSubscriber, stopped after the test."""
    started: list[EventSubscriber] = []

    def make(sources: list[Source], **options) -> EventSubscriber:
        if options:
            sub = EventSubscriber(sources, subscriber_mod.FeedOptions(**options))
        else:
            sub = EventSubscriber(sources)
        started.append(sub.start())
        assert sub.ready.wait(15)
        return sub

    yield make
    for sub in started:
        sub.stop()


# ---- item 4: garbled seq numbers -----------------------------------------------------------------------
def test_a_nine_byte_seq_is_dropped_and_counted_and_every_source_goes_on(tmp_path, feed) -> None:
    a, b = RawPublisher(tmp_path, "a"), RawPublisher(tmp_path, "b")
    index = PrefixIndex()
    try:
        sub = feed([Source("a", a.endpoint, a.replay_endpoint, index.apply_engine),
                    Source("b", b.endpoint, b.replay_endpoint, index.apply_engine)])  # fmt: skip
        settle()
        a.publish(blocks(0, 1))
        until(lambda: index.local_tokens("a", prompt(0, 1)) == 4)
        for extra in (5, 10):  # before: the second one's gap replay raised OverflowError, ending the thread
            a.send_raw(b"", (2**64 + extra).to_bytes(9, "big"), payload(blocks(500 + extra, 3)))
        b.publish(blocks(100, 2))
        a.publish(blocks(1, 1, parent=(0).to_bytes(16, "big")))
        until(
            lambda: (
                index.local_tokens("b", prompt(100, 2)) == 8 and index.local_tokens("a", prompt(0, 2)) == 8
            )
        )
        assert index.local_tokens("a", prompt(505, 3)) == 0 and index.local_tokens("a", prompt(510, 3)) == 0
        assert sub.sources[0].malformed == 2 and sub.sources[1].malformed == 0
        assert sub.alive
    finally:
        a.close()
        b.close()


def test_a_seq_of_2_64_minus_1_does_not_make_later_batches_duplicates(tmp_path, feed) -> None:
    a = RawPublisher(tmp_path, "a")
    index = PrefixIndex()
    try:
        sub = feed([Source("a", a.endpoint, a.replay_endpoint, index.apply_engine)])
        settle()
        a.publish(blocks(0, 1))
        until(lambda: index.local_tokens("a", prompt(0, 1)) == 4)
        a.send_raw(b"", (2**64 - 1).to_bytes(8, "big"), payload(blocks(700, 3)))
        a.publish(blocks(1, 1, parent=(0).to_bytes(16, "big")))
        a.publish(blocks(2, 1, parent=(1).to_bytes(16, "big")))
        until(lambda: index.local_tokens("a", prompt(0, 3)) == 12)
        assert index.local_tokens("a", prompt(700, 3)) == 0
        assert sub.sources[0].last_seq == 2 and sub.sources[0].malformed == 1
    finally:
        a.close()


@pytest.mark.parametrize("forged_seq", [2**62, 2**64 - 1])
def test_a_forged_replay_answer_is_not_believed_for_long(tmp_path, feed, forged_seq) -> None:
    a = RawPublisher(tmp_path, "a")
    index = PrefixIndex()
    try:
        a.publish(blocks(0, 1))  # before the router: only the replay has it
        a.forged_answer = [(forged_seq.to_bytes(8, "big"), payload(blocks(800, 3)))]  # the first replay's
        sub = feed([Source("a", a.endpoint, a.replay_endpoint, index.apply_engine)])
        settle()
        a.publish(blocks(1, 1, parent=(0).to_bytes(16, "big")))
        until(lambda: index.local_tokens("a", prompt(0, 2)) == 8)
        assert index.local_tokens("a", prompt(800, 3)) == 0  # the forged blocks are gone (or never came)
        assert sub.sources[0].last_seq == 1
    finally:
        a.close()


def test_a_wrong_topic_or_shape_is_dropped_and_counted(tmp_path, feed) -> None:
    a = RawPublisher(tmp_path, "a", topic=b"kv")
    index = PrefixIndex()
    try:
        sub = feed([Source("a", a.endpoint, a.replay_endpoint, index.apply_engine, topic="kv")])
        settle()
        a.send_raw(
            b"kv-forged", (0).to_bytes(8, "big"), payload(blocks(900, 2))
        )  # the SUB's prefix passes it
        a.send_raw(b"kv", (0).to_bytes(8, "big"))
        a.send_raw(b"kv", (0).to_bytes(8, "big"), payload(blocks(900, 2)), b"extra")
        a.send_raw(b"kv", (0).to_bytes(8, "big"), b"\xc1 not msgpack")  # seq 0 used up, undecodable
        a.seq = 1
        a.buffer.append((0, b"\xc1 not msgpack"))
        a.publish(blocks(0, 2))
        until(lambda: index.local_tokens("a", prompt(0, 2)) == 8)
        assert index.local_tokens("a", prompt(900, 2)) == 0
        assert sub.sources[0].malformed == 4 and sub.sources[0].untrusted == 0
    finally:
        a.close()


def test_a_source_whose_apply_raises_does_not_stop_the_others(tmp_path, feed) -> None:
    a, b = RawPublisher(tmp_path, "a"), RawPublisher(tmp_path, "b")
    index = PrefixIndex()

    def broken(name: str, events: list) -> None:
        raise RuntimeError("boom")

    try:
        sub = feed([Source("a", a.endpoint, None, broken), Source("b", b.endpoint, None, index.apply_engine)])
        settle()
        a.publish(blocks(0, 1))
        b.publish(blocks(0, 1))
        until(lambda: index.local_tokens("b", prompt(0, 1)) == 4)
        assert sub.sources[0].errors >= 1 and sub.alive
    finally:
        a.close()
        b.close()


def test_a_bad_endpoint_costs_its_source_only_and_a_dead_thread_shows(tmp_path, feed, monkeypatch) -> None:
    b = RawPublisher(tmp_path, "b")
    index = PrefixIndex()
    try:
        sub = feed([Source("a", "bogus://nowhere", None, index.apply_engine),
                    Source("b", b.endpoint, None, index.apply_engine)])  # fmt: skip
        settle()
        b.publish(blocks(0, 1))
        until(lambda: index.local_tokens("b", prompt(0, 1)) == 4)
        assert sub.sources[0].errors == 1 and sub.alive
        monkeypatch.setattr(sub._poller, "poll", lambda *a: 1 / 0)  # a bug outside any one source's handling
        until(lambda: not sub.alive, what="the thread's end")  # then the router's /health answers 503
    finally:
        b.close()


# ---- item 5: a restarted publisher ---------------------------------------------------------------------
def _stores(first: int, n: int) -> list:
    return [block_stored([k.to_bytes(16, "big")], None, [], 0, "CPU") for k in range(first, first + n)]


def test_a_restarted_publisher_is_replayed_from_0_and_its_old_chunks_forgotten(tmp_path, feed) -> None:
    cfg = KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/s-pub", f"ipc://{tmp_path}/s-replay")
    old = [k.to_bytes(16, "big") for k in range(30)]
    new = [k.to_bytes(16, "big") for k in range(1000, 1030)]
    index = PrefixIndex()
    pub = ZmqEventPublisher(cfg)
    try:
        pub.publish([all_blocks_cleared()])
        for e in _stores(0, 30):
            pub.publish([e])
        sub = feed([Source("store0", cfg.endpoint, cfg.replay_endpoint, index.apply_store)])
        until(lambda: index.store_chunks(old) == 30)
        pub.shutdown()
        pub = ZmqEventPublisher(cfg)  # restarted: seq 0 again; all of this goes before the SUB reconnects
        pub.publish([all_blocks_cleared()])
        for e in _stores(1000, 30):
            pub.publish([e])
        until(lambda: index.store_chunks(new) == 30 and index.store_chunks(old[:1]) == 0, 15)
        settle()
        pub.publish(_stores(2000, 1))  # seq 31: one above the old process's last
        until(lambda: index.store_chunks([(2000).to_bytes(16, "big")]) == 1)
        assert index.store_chunks(old[:1]) == 0 and sub.sources[0].resyncs >= 1
    finally:
        pub.shutdown()


def test_a_restarted_publisher_whose_next_seq_is_the_old_last_plus_1_is_still_noticed(tmp_path, feed) -> None:
    """The new process's first batch the router sees has exactly the seq it expects next: only the
    check after the reconnection (its replay's batches differ from those applied) tells."""
    a = RawPublisher(tmp_path, "a")
    index = PrefixIndex()
    try:
        a.publish(blocks(0, 3))
        feed([Source("a", a.endpoint, a.replay_endpoint, index.apply_engine)], check_s=0)
        until(lambda: index.local_tokens("a", prompt(0, 3)) == 12)
        a.close()
        time.sleep(0.3)
        a = RawPublisher(tmp_path, "a")  # restarted: its batch 0 lost, batch 1 is what the router expects
        a.publish([all_blocks_cleared()])
        settle()
        a.publish(blocks(50, 2))
        until(
            lambda: index.local_tokens("a", prompt(50, 2)) == 8 and index.local_tokens("a", prompt(0, 1)) == 0
        )
    finally:
        a.close()


def test_without_a_replay_endpoint_a_seq_going_back_resets_the_source(tmp_path, feed) -> None:
    a = RawPublisher(tmp_path, "a")
    index = PrefixIndex()
    try:
        feed([Source("a", a.endpoint, None, index.apply_engine)])
        settle()
        for k in range(5):
            a.publish(blocks(k, 1, parent=k.to_bytes(16, "big") if k else None))
        until(lambda: index.local_tokens("a", prompt(0, 1)) == 4)
        a.seq = 2  # a restarted publisher (its first batches lost): seq 2 again, other content
        a.publish(blocks(60, 1))
        until(lambda: index.local_tokens("a", prompt(60, 1)) == 4)
        assert index.local_tokens("a", prompt(0, 1)) == 0
    finally:
        a.close()


# ---- item 6: frame sizes, a bounded index --------------------------------------------------------------
def test_frames_over_the_limit_are_never_read(tmp_path, feed, monkeypatch) -> None:
    seen: list[int] = []
    real = subscriber_mod.decode_batch

    def spy(data: bytes):
        seen.append(len(data))
        return real(data)

    monkeypatch.setattr(subscriber_mod, "decode_batch", spy)
    a = RawPublisher(tmp_path, "a")
    index = PrefixIndex()
    try:
        feed([Source("a", a.endpoint, a.replay_endpoint, index.apply_engine)])
        settle()
        a.send_raw(b"", (0).to_bytes(8, "big"), bytes(32 << 20))  # 32 MiB: over the 4 MiB default
        a.forged_answer = [((0).to_bytes(8, "big"), bytes(32 << 20))]  # the next replay's answer too
        time.sleep(0.5)  # the SUB reconnects
        a.publish(blocks(0, 2))
        until(lambda: index.local_tokens("a", prompt(0, 2)) == 8)
        assert max(seen) < 1 << 20, seen
    finally:
        a.close()


def test_the_index_is_bounded_oldest_first_and_says_so() -> None:
    index = PrefixIndex()
    cap = 262_144  # the default: blocks per engine
    n = cap + 5000
    hashes = [k.to_bytes(16, "big") for k in range(n)]
    for i in range(0, n, 50_000):  # a forger's blocks: one token each, all chained
        chunk = hashes[i : i + 50_000]
        parent = hashes[i - 1] if i else None
        index.apply_engine("e", [block_stored(chunk, parent, list(range(i, i + len(chunk))), 1, "GPU")])
    assert index.stats()["engines"]["e"] == cap
    assert index.sizes()["e"] == (cap, 5000)
    assert index.local_tokens("e", list(range(10))) == 0  # the oldest went first
    small = PrefixIndex(max_engine_blocks=10, max_store_keys=3)
    small.apply_store("s", [block_stored([bytes([k]) * 16 for k in range(5)], None, [], 0, "CPU")])
    small.apply_store("s", [block_stored([bytes([4]) * 16], None, [], 0, "REDIS")])
    assert small.stats()["stores"]["s"] == {"CPU": 3, "REDIS": 1} and small.sizes()["s"] == (3, 2)
    assert small.store_chunks([bytes([0]) * 16]) == 0 and small.store_chunks([bytes([4]) * 16]) == 1


# ---- item 10: forged events do not steer routing --------------------------------------------------------
def test_a_router_with_the_token_reads_only_that_publisher(tmp_path) -> None:
    """A forger holds engine 0's endpoint and announces 20 blocks of a prompt; the router, given the
    engines' token, never completes a handshake with it: the prompt is not steered to engine 0."""
    from kvstore.engine.router.router import Router, RouterConfig
    from kvstore.engine.router.subscriber import FeedOptions
    from kvstore.engine.router.tokens import PromptTokens

    from tests.engine.conftest import make_tiny_engine_dir

    token = "engines-token-" + "x" * 20
    model = make_tiny_engine_dir(tmp_path / "llama")
    real = ZmqEventPublisher(
        KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/e1-pub", f"ipc://{tmp_path}/e1-replay", auth="curve"),
        token=token,
    )
    forger = RawPublisher(tmp_path, "e0")
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    config = RouterConfig(
        urls, [forger.endpoint, real.config.endpoint], [forger.replay_endpoint, real.config.replay_endpoint],
        policy="prefix", calibrate_s=0, events=FeedOptions(engine_token=token),
    )  # fmt: skip
    router = Router(config, PromptTokens(model, chunk_size=16))
    router.subscriber.start()
    try:
        assert router.subscriber.ready.wait(15)
        settle()
        tokens = list(range(1, 16 * 20 + 2))
        forged = [k.to_bytes(16, "big") for k in range(20)]
        for _ in range(3):
            forger.publish([block_stored(forged, None, tokens[: 16 * 20], 16, "GPU")])
        real.publish([block_stored([b"r" * 16], None, list(range(500, 516)), 16, "GPU")])
        until(lambda: router.index.local_tokens(urls[1], list(range(500, 517))) == 16)
        assert router.index.local_tokens(urls[0], tokens) == 0
        choices = [router.decide(tokens, "prefix") for _ in range(5)]  # before: 5 of 5 to engine 0, for
        assert all(c.local_tokens == 0 for c in choices)  # the 320 tokens the forger said it holds
        assert router.state(time.monotonic())["sources"][urls[0]]["batches"] == 0
    finally:
        router.subscriber.stop()
        forger.close()
        real.shutdown()
