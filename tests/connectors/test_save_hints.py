"""The connector's saves carry their chunks' token ids and parents (kvstore.token_hints), so a
kvstore-server's KV events can name the tokens of what the connector stored: the scheduler plans them,
the saver puts them beside the blobs, and a chunk whose KV does not hold that many tokens goes
without them (never a refused put)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.kv_saver import ChunkSaver
from kvstore.connectors.meta import SaveSpec
from kvstore.connectors.metrics import ConnectorMetrics
from kvstore.engine.scheduler import SchedulerOutput

from tests.connectors.test_engine_scheduler import scheduler_pair, seq  # noqa: F401 (fixture)


def test_the_scheduler_plans_each_save_with_its_tokens_and_parent(scheduler_pair) -> None:  # noqa: F811
    sched = scheduler_pair()
    s = seq("r1", 600)  # two full chunks of 256, then 88 tokens: a partial chunk of 80 (five blocks)
    sched.add_sequence(s)
    out = sched.schedule()
    keys = sched.connector.scheduler.chunk_keys_of("r1").keys
    saves = out.kv_connector_metadata.payload["kvstore_transfers"].saves
    tokens = s.all_token_ids
    assert [(sv.key, sv.token_ids, sv.parent) for sv in saves] == [
        (keys[0], tuple(tokens[:256]), None),
        (keys[1], tuple(tokens[256:512]), keys[0]),
    ]
    sched.update_from_output(out, [7])
    sched.abort("r1")
    (partial,) = sched.connector.build_connector_meta(SchedulerOutput()).payload["kvstore_transfers"].saves
    assert partial.partial and partial.token_ids == tuple(tokens[512:592]) and partial.parent == keys[1]


class Handle:
    """What the saver asks of the store: nothing stored yet; every put recorded."""

    def __init__(self) -> None:
        self.metrics = ConnectorMetrics()
        self.puts: list[tuple] = []

    def reachable(self) -> bool:
        return True

    def batch_exists(self, keys):
        return [False] * len(keys)

    def batch_put_blobs(self, items, replaces=(), token_ids=None, parents=None) -> None:
        self.puts.append(([k for k, _ in items], token_ids, parents))


def test_the_saver_puts_the_hints_that_fit_the_chunks_kv() -> None:
    config = KVTransferConfig(store_url="local", block_size=16, chunk_size=32)
    handle = Handle()
    saver = ChunkSaver(config, handle, SimpleNamespace())
    kv = [torch.zeros(2, 1, 32, 1, 8), torch.zeros(2, 1, 32, 1, 8), torch.zeros(2, 1, 16, 1, 8)]
    saves = [
        SaveSpec("r", "aa" * 16, 0, (0, 1), token_ids=tuple(range(32))),
        SaveSpec("r", "bb" * 16, 1, (2, 3), token_ids=tuple(range(32, 64)), parent="aa" * 16),
        SaveSpec("r", "cc" * 16, 2, (4,), partial=True, token_ids=tuple(range(64, 80)), parent="bb" * 16),
    ]
    saves.append(SaveSpec("r", "dd" * 16, 2, (5,), partial=True, token_ids=(1, 2, 3), parent="bb" * 16))
    kv.append(torch.zeros(2, 1, 16, 1, 8))  # 16 tokens of KV, 3 token ids: no hint
    saver.submit(saves, lambda i, out: kv[i])
    saver.flush(10)
    saver.shutdown()
    ((keys, token_ids, parents),) = handle.puts
    assert keys == ["aa" * 16, "bb" * 16, "cc" * 16, "dd" * 16]
    assert token_ids == [tuple(range(32)), tuple(range(32, 64)), tuple(range(64, 80)), None]
    assert parents == [None, "aa" * 16, "bb" * 16, None]
