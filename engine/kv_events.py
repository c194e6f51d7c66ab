"""The engine's KV events (`--kv-events-config`): its prefix cache's changes, published after every step
in vLLM's wire format (kvstore.events) with medium "GPU" (the engine's own cache, as vLLM names it).

The first batch is AllBlocksCleared: a restarted engine tells subscribers (and, through replay, a
router that starts later) to forget what its previous process held. Block hashes go out in vLLM's form
(64-bit integers by default, `"int_block_hashes": false` for bytes: the publisher converts them), with
the token ids Dynamo's and llm-d's indexers hash themselves.

The events carry the prompts' token ids (BlockStored.token_ids): whoever reads them can rebuild what
users asked. The default endpoint is an ipc:// socket file only this user can connect to; off this host,
give `token_file` (CURVE, keys derived from the token: `kvstore-engine router --engine-events-token-file`
reads them, an anonymous subscriber gets nothing). kvstore.events has the options.
"""

from __future__ import annotations

from typing import Any

from kvstore.engine.block_manager import BlockManager

from kvstore.events import (
    MEDIUM_GPU,
    KVEventsConfig,
    ZmqEventPublisher,
    all_blocks_cleared,
    block_removed,
    block_stored,
    parse_kv_events_config,
)


class EngineKVEvents:
    def __init__(self, config: KVEventsConfig, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.publisher = ZmqEventPublisher(config)
        block_manager.events = []
        self.publisher.publish([all_blocks_cleared()])

    @classmethod
    def create(cls, value: str | dict | None, block_manager: BlockManager) -> EngineKVEvents | None:
        config = parse_kv_events_config(value)
        return cls(config, block_manager) if config.enabled else None

    def flush(self) -> None:
        """Publish the prefix-cache changes of the step that just ran (one batch, none when nothing changed)."""
        changes = self.block_manager.take_events()
        if not changes:
            return
        bs = self.block_manager.block_size
        events: list[Any] = []
        for change in changes:
            if change[0] == "stored":
                _, hashes, parent, tokens = change
                events.append(block_stored(list(hashes), parent, tokens, bs, MEDIUM_GPU))
            else:
                events.append(block_removed(list(change[1]), MEDIUM_GPU))
        self.publisher.publish(events)

    def shutdown(self) -> None:
        self.flush()
        self.publisher.shutdown()
