"""Reading KV events as a third party would: raw ZMQ sockets and vLLM's own msgspec classes."""

from __future__ import annotations

import time

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def subscribe(endpoint: str, topic: str = "") -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt_string(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket, until, timeout_s: float = 10.0) -> list[tuple[int, KVEventBatch]]:
    """(seq, batch) frames until `until(batches)` holds or the time is up."""
    out: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + timeout_s
    while not until(out) and time.monotonic() < deadline:
        if sock.poll(50):
            _topic, seq, payload = sock.recv_multipart()
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return out


def replay(endpoint: str, start: int = 0, timeout_s: float = 10.0) -> list[tuple[int, KVEventBatch]]:
    """Ask a replay (ROUTER) endpoint for every batch from `start` on, as vLLM's subscribers do."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(100):
                continue
            _, _topic, seq, payload = sock.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                return out
            out.append((n, DECODER.decode(payload)))
        raise TimeoutError("no end-of-replay marker")
    finally:
        sock.close()


def events(batches: list[tuple[int, KVEventBatch]]) -> list:
    return [e for _, b in batches for e in b.events]


def settle() -> None:
    """ZMQ's slow joiner: a SUB that just connected misses what is published in its first ms."""
    time.sleep(0.3)
