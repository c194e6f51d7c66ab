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
Cluster). A server's block hashes are its chunk keys; an engine's are its block hashes
(kvstore.keys.hash_block chained from its root) with `parent_block_hash` None for a prompt's first
block, as vLLM does. Both are 16+ bytes; on the wire they take vLLM's form (`external_block_hash`): by
default, as vLLM 0.32 (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), a 64-bit integer, the low 64 bits of the
bytes read big-endian (their last 8 bytes); with `"int_block_hashes": false` the bytes themselves.
Dynamo's indexer reads only the integers. The publisher converts every BlockStored / BlockRemoved it
sends (parents too), so the engine, the server and anyone publishing through it agree.

Endpoints behave as vLLM's: one with `*`, `::`, or `ipc://` / `inproc://` is bound, any other is
connected to; the replay endpoint is always bound. A publisher that connects (to a subscriber that
binds, as llm-d's indexer does) holds its batches until that peer's subscription has reached it, then
sends them in order: an XPUB drops what no subscription matches, and a bound SUB sends its
subscription to a peer that connected only once its own thread next polls or reads, so without the
hold every batch published before then was lost (AllBlocksCleared always). At most `hwm` batches are
held (the oldest go first, counted in `unsent`). After that, libzmq keeps the connection's queue across
reconnects: batches published while the peer is away reach it when it is back (up to `hwm`). pyzmq and
msgspec come with vLLM; they are imported only when events are enabled.

What kvstore adds to vLLM's config (fields vLLM does not have; a vLLM config is read unchanged):

- The default endpoint is `ipc:///tmp/kvstore-kv-events` (vLLM's is `tcp://*:5557`, every interface):
  an ipc socket file only its owner's user can connect to. A second process binding the same ipc path
  is refused (libzmq would silently take the path over).
- `bind`: true binds the endpoint whatever vLLM's rule says (the way to keep a TCP publisher on
  loopback: `tcp://127.0.0.1:5557` is connected to by vLLM's rule); false connects; null: vLLM's rule.
- `auth`: "curve" encrypts and authenticates both sockets with ZMQ CURVE, the publisher's key pair
  derived from a token (`curve_keys`): only a subscriber that holds the token can connect, read events
  or ask for the replay. "none": plain ZMQ, as vLLM. null (the default): "curve" when the process has
  a token (a kvstore-server's `--auth-token`, or `token_file`), else "none". A publisher that binds or
  connects to a non-loopback address without CURVE logs a WARNING.
- `token_file`: a file holding the token the CURVE keys are derived from (the engine has no token of
  its own; for a server it replaces the server's token).
- `int_block_hashes`: true, block hashes as 64-bit integers (vLLM's default form); false, as bytes;
  null (the default): vLLM's own switch, the environment variable VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
  (unset: 1, integers).
- `reconcile_s` (servers): every this many seconds the server checks that the chunks it announced are
  still in their tiers and publishes BlockRemoved for those gone without it seeing (evictions Valkey
  made on its own, TTL expiry); 0: never.

Hostile peers: every socket refuses frames over a few hundred bytes from its peers (ZMQ_MAXMSGSIZE:
such a peer is disconnected before the frame is read). libzmq keeps every subscription a peer sends in
a table it never bounds (~48 bytes per byte sent), so the PUB socket is an XPUB that shows them to the
publisher, a few at a time (RCVHWM): past JUNK_SUBSCRIPTION_BYTES of subscriptions the topic does not
match, the socket is closed and opened again (the table goes with it; subscribers reconnect on their
own, a router recovers what it missed from the replay), counted in `reopened`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import queue
import socket
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
MAX_SEQ = 2**63 - 1  # vLLM counts from 0, one a batch: a seq above this (or END_SEQ) is no batch's
DEFAULT_ENDPOINT = "ipc:///tmp/kvstore-kv-events"
CONTROL_MAX_BYTES = 4096  # the largest frame a publisher reads from a peer (subscriptions, replay requests)
MAX_SUBSCRIPTIONS_PER_POLL = 1000  # subscription messages read between two batches
SUBSCRIPTION_HWM = 64  # subscription messages libzmq takes in from one peer before the publisher reads
SUBSCRIPTION_MAX_BYTES = 512  # the largest frame the PUB socket reads from a peer (+ the topic's length)
JUNK_SUBSCRIPTION_BYTES = 64 << 10  # subscriptions matching no topic of ours before the PUB is reopened
AUTH_MODES = ("curve", "none")
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"  # vLLM's switch (vllm/envs.py), default 1
HASH_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field (`--kv-events-config` takes it as JSON), then kvstore's own
    (see the module docstring): `bind`, `auth`, `token_file`, `int_block_hashes`, `reconcile_s`."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    bind: bool | None = None  # None: vLLM's rule (module docstring)
    auth: str | None = None  # "curve" | "none"; None: "curve" when there is a token
    token_file: str | None = None
    int_block_hashes: bool | None = None  # None: $VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, default integers
    reconcile_s: float = 30.0

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
    for name in ("endpoint", "topic"):
        if not isinstance(getattr(config, name), str):
            raise ConfigError(f"--kv-events-config: {name} must be a string")
    if config.bind not in (None, True, False):
        raise ConfigError("--kv-events-config: bind must be true, false or null")
    if config.auth not in (None, *AUTH_MODES):
        raise ConfigError(f"--kv-events-config: auth must be one of {list(AUTH_MODES)} or null")
    if config.token_file is not None and not isinstance(config.token_file, str):
        raise ConfigError("--kv-events-config: token_file must be a path")
    if config.int_block_hashes is not None and not isinstance(config.int_block_hashes, bool):
        raise ConfigError("--kv-events-config: int_block_hashes must be true, false or null")
    int_block_hashes(config)  # a bad VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES stops here too
    r = config.reconcile_s
    if isinstance(r, bool) or not isinstance(r, int | float) or not 0 <= r < 1e9:
        raise ConfigError("--kv-events-config: reconcile_s must be a number of seconds >= 0")
    return config


def int_block_hashes(config: KVEventsConfig) -> bool:
    """Whether block hashes go out as 64-bit integers: `int_block_hashes`, else vLLM's switch
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES read as vLLM reads it (`bool(int(value))`, unset: 1)."""
    if config.int_block_hashes is not None:
        return config.int_block_hashes
    value = os.environ.get(INT_HASHES_ENV, "1")
    try:
        return bool(int(value))
    except ValueError:
        raise ConfigError(f"{INT_HASHES_ENV} must be 0 or 1, got {value!r}") from None


def external_block_hash(block_hash: bytes | int, as_int: bool = True) -> bytes | int:
    """A block hash as vLLM publishes it (`vllm.v1.core.kv_cache_utils.maybe_convert_block_hash`):
    with `as_int`, the low 64 bits of the bytes read big-endian (a chunk key's last 8 bytes), else the
    bytes unchanged; an int is already in that form. The router compares hashes in this form too."""
    if not as_int or isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash, byteorder="big") & HASH_MASK


def _with_int_hashes(event: Any) -> Any:
    """`event` with its block hashes (and parent) in the 64-bit integer form."""
    import msgspec

    hashes = getattr(event, "block_hashes", None)
    if hashes is None:
        return event
    changes: dict[str, Any] = {"block_hashes": [external_block_hash(h) for h in hashes]}
    parent = getattr(event, "parent_block_hash", None)
    if parent is not None:
        changes["parent_block_hash"] = external_block_hash(parent)
    return msgspec.structs.replace(event, **changes)


def curve_keys(token: str) -> tuple[bytes, bytes]:
    """The CURVE key pair (public, secret; Z85) of a publisher whose token is `token`.

    Both come from the token (BLAKE2b, personalised): a subscriber that holds the token sets the public
    one as its `curve_serverkey`, with a key pair of its own (any: `zmq.curve_keypair()`). The public
    key never crosses the wire in a CURVE handshake, and a client that does not know it cannot complete
    one: knowing the token is what lets a subscriber in."""
    import zmq
    from zmq.utils import z85

    seed = hashlib.blake2b(token.encode(), digest_size=32, person=b"kvstore-kvevents").digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def curve_server_key(token: str) -> bytes:
    """What a subscriber sets as `curve_serverkey` to read a publisher whose token is `token`."""
    return curve_keys(token)[0]


def is_local_endpoint(endpoint: str) -> bool:
    """Whether only this host can reach `endpoint`: ipc://, inproc://, or TCP on a loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    if ";" in host:  # tcp://source;target: where it goes is the target
        host = host.split(";", 1)[1]
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, a host name: not provably local


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


def _is_bind_endpoint(endpoint: str, bind: bool | None = None) -> bool:
    """vLLM's rule (wildcard, ipc and inproc endpoints are bound, the rest connected to) unless `bind`."""
    if bind is not None:
        return bind
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _claim_ipc(endpoint: str, wait_s: float = 1.0) -> None:
    """Refuse an ipc:// path another publisher listens on: libzmq would unlink it and bind anew, and the
    other one's subscribers would silently read this one. A path nobody answers on (left by a process
    that died, or one closing: waited for up to `wait_s`) is free."""
    path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else ""
    if not path or path.startswith("@") or path == "*":
        return
    deadline = time.monotonic() + wait_s
    while os.path.exists(path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(path)
            except OSError:
                return
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"KV events: {endpoint} is in use by another process: give each publisher its own endpoint"
            )
        time.sleep(0.05)


def event_token(config: KVEventsConfig, token: str | None = None) -> str | None:
    """The token a publisher's CURVE keys come from: `token_file`'s, else `token` (a server's own)."""
    if config.token_file:
        from kvstore.settings import read_token  # noqa: PLC0415

        return read_token(None, config.token_file)
    return token


class _Every:
    """At most one log line per `period_s` for one kind of nuisance (a hostile peer must not fill logs)."""

    def __init__(self, period_s: float = 10.0) -> None:
        self.period_s, self._next = period_s, 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.period_s
        return True


class ZmqEventPublisher:
    """XPUB (subscriptions watched) + ROUTER replay, from one thread; `publish` only enqueues (bounded,
    never blocks). `token`: the process's own token (a server's), for `auth` (module docstring)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, token: str | None = None) -> None:
        try:
            import zmq
        except ImportError as e:
            raise ConfigError(f"KV events need pyzmq and msgspec (they come with vLLM): {e}") from None
        self.config = config
        self.dp_rank = data_parallel_rank
        self.published = 0
        self.dropped = 0  # batches the full queue refused
        self.junk_subscriptions = 0  # subscriptions the topic does not match
        self.reopened = 0  # times the PUB socket was reopened to drop them
        self._junk_bytes = 0
        self.bad_requests = 0  # replay requests not in vLLM's shape
        self.unsent = 0  # connect mode: batches dropped from the hold before the peer subscribed
        self.int_hashes = int_block_hashes(config)
        token = event_token(config, token)
        self.curve = config.auth == "curve" or (config.auth is None and token is not None)
        if self.curve and token is None:
            raise ConfigError(
                '--kv-events-config: auth "curve" needs a token: token_file, or the server\'s own'
            )
        if self.curve and not zmq.has("curve"):
            raise ConfigError(
                '--kv-events-config: auth "curve" needs a libzmq with CURVE (pyzmq wheels have it)'
            )
        secret = curve_keys(token)[1] if self.curve and token is not None else None
        self._queue: queue.Queue[list[Any] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._topic = config.topic.encode()
        self._log_refused, self._log_bad = _Every(), _Every()
        self._ctx = zmq.Context.instance()
        self._secret = secret
        self._pub: Any = None
        self._replay = None
        self.bound = _is_bind_endpoint(config.endpoint, config.bind)
        # Connect mode: batches wait here until the peer's subscription has reached the XPUB (module
        # docstring); a bound socket sends at once (its subscribers come and go: they replay).
        self._held: deque[tuple[int, bytes]] = deque()
        self.peer_subscribed = self.bound
        try:
            self._open_pub()
            if config.replay_endpoint:
                self._replay = self._socket(zmq.ROUTER, secret, config.replay_endpoint)
                _claim_ipc(config.replay_endpoint)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(
                f"KV events: cannot open {config.endpoint} / {config.replay_endpoint}: {e}"
            ) from None
        except ConfigError:
            self._close_sockets()
            raise
        self._warn_if_exposed()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _open_pub(self, wait_s: float = 0.0) -> None:
        """The PUB socket (an XPUB showing every subscription), bound or connected; a bind is retried for
        up to `wait_s` while the endpoint is still held (by the socket this one replaces)."""
        import zmq

        endpoint = self.config.endpoint
        sock = self._socket(zmq.XPUB, self._secret, endpoint, SUBSCRIPTION_MAX_BYTES)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, SUBSCRIPTION_HWM)
        self._pub = sock
        if not self.bound:
            sock.connect(endpoint)
            return
        deadline = time.monotonic() + wait_s
        while True:
            try:
                _claim_ipc(endpoint)
                sock.bind(endpoint)
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _reopen_pub(self) -> None:
        """Close the PUB socket and open it again: the subscriptions libzmq kept for its peers go too."""
        path = self.config.endpoint[len("ipc://") :] if self.config.endpoint.startswith("ipc://") else ""
        self._pub.close(linger=0)
        self._pub = None
        deadline = time.monotonic() + 2.0
        while self.bound and path and os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)  # the closing listener unlinks its path: bind only once it has
        self._open_pub(wait_s=2.0)
        self.reopened += 1
        if not self.bound:
            self.peer_subscribed = False  # a new connection: hold again until the peer subscribes

    def _socket(
        self, kind: int, secret: bytes | None, endpoint: str, max_bytes: int = CONTROL_MAX_BYTES
    ) -> Any:
        import zmq

        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + len(self._topic))  # peers send only small frames
        if endpoint.startswith("tcp://[") or "::" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        if secret is not None:
            sock.curve_server = True
            sock.curve_secretkey = secret
        return sock

    def _warn_if_exposed(self) -> None:
        config = self.config
        if self.curve:
            logger.info("KV events on %s%s: CURVE, keys from the token", config.endpoint,
                        f" (replay {config.replay_endpoint})" if config.replay_endpoint else "")  # fmt: skip
            return
        for endpoint, bound in ((config.endpoint, self.bound), (config.replay_endpoint, True)):
            if endpoint and not is_local_endpoint(endpoint):
                logger.warning(
                    "KV events: %s %s without authentication: whoever reaches it reads every event (an "
                    "engine's prompts as token ids, a server's chunk keys) %s. Keep it on ipc:// or loopback "
                    '("bind": true for tcp://127.0.0.1:PORT), or set a token ("auth": "curve")',
                    endpoint,
                    "is bound on a non-loopback interface" if bound else "is sent to, off this host",
                    "and the replay buffer" if endpoint == config.replay_endpoint else "as it is published",
                )  # fmt: skip

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
            try:
                if self._pub.poll(0):
                    self._watch_subscriptions()
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
            except Exception:  # a peer must never end the thread
                logger.exception("KV events: serving a peer failed")
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if events is None:
                break
            if self.int_hashes:
                events = [_with_int_hashes(e) for e in events]
            seq = next(self._seq)
            payload = encoder.encode(
                batch_cls(ts=time.time(), events=events, data_parallel_rank=self.dp_rank)
            )
            if self.peer_subscribed:
                self._send(seq, payload)
            else:
                self._hold(seq, payload)
            self._buffer.append((seq, payload))
            self.published += 1

    def _send(self, seq: int, payload: bytes) -> None:
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception:  # a ZMQ failure must not end the thread: the batch stays replayable
            logger.exception("KV events: publishing batch %d failed", seq)

    def _hold(self, seq: int, payload: bytes) -> None:
        """Keep a batch until the peer this publisher connects to has subscribed (at most `hwm`)."""
        if len(self._held) >= self.config.hwm:
            self._held.popleft()
            self.unsent += 1
        self._held.append((seq, payload))

    def _peer_ready(self) -> None:
        """The connected peer subscribed: what was held goes out, in order, and from now on every batch."""
        self.peer_subscribed = True
        held, self._held = self._held, deque()
        if held or self.unsent:
            logger.info("KV events: %s subscribed; %d held batch(es) sent%s", self.config.endpoint, len(held),
                        f", {self.unsent} dropped (more than hwm)" if self.unsent else "")  # fmt: skip
        for seq, payload in held:
            self._send(seq, payload)

    def _watch_subscriptions(self) -> None:
        """Read the subscriptions peers sent (`\\x01` + a prefix of the topic, `\\x00` to cancel); those
        the topic does not match are counted, and past JUNK_SUBSCRIPTION_BYTES of them the PUB socket is
        reopened (libzmq would keep every one for as long as the socket lives)."""
        import zmq

        for _ in range(MAX_SUBSCRIPTIONS_PER_POLL):
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(msg) >= 1 and msg[0] in (0, 1) and self._topic.startswith(msg[1:]):
                if msg[0] == 1 and not self.peer_subscribed:
                    self._peer_ready()
                continue
            self.junk_subscriptions += 1
            self._junk_bytes += len(msg) + 64  # + what libzmq keeps per message and trie node
            if self._junk_bytes > JUNK_SUBSCRIPTION_BYTES:
                self._junk_bytes = 0
                if self._log_refused():
                    logger.warning(
                        "KV events: peers of %s sent %d subscriptions for topics it does not publish; "
                        "its socket is reopened to drop them (%d times so far): subscribers reconnect",
                        self.config.endpoint, self.junk_subscriptions, self.reopened + 1,
                    )  # fmt: skip
                self._reopen_pub()
                return

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.bad_requests += 1
            if self._log_bad():
                logger.warning("KV events: a replay request of %d frames ignored (%d so far)", len(frames),
                               self.bad_requests)  # fmt: skip
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
            if self._held:
                logger.warning("KV events: %d batch(es) never sent: nothing subscribed at %s",
                               len(self._held), self.config.endpoint)  # fmt: skip


def make_publisher(value: str | Mapping[str, Any] | KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher `--kv-events-config` asks for, or None when events are off (the default)."""
    config = parse_kv_events_config(value)
    return ZmqEventPublisher(config) if config.enabled else None
