"""What the scheduler-side connector tells the worker-side one each step (inside
`KVConnectorMetadata.payload`): which store chunks to load into which blocks, which to save."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadSpec:
    """Fill tokens `[start_token, end_token)` of a request from the store.

    `keys[i]` is chunk `first_chunk + i` and holds `chunk_tokens[i]` tokens (chunk_size, or fewer
    for a partial chunk, which can only be the last); `block_ids` is the request's block table (at
    least up to `end_token`). Both token bounds are block-aligned.
    """

    request_id: str
    keys: tuple[str, ...]
    first_chunk: int
    block_ids: tuple[int, ...]
    start_token: int
    end_token: int
    chunk_tokens: tuple[int, ...] = ()

    def chunk_indices(self) -> range:
        return range(self.first_chunk, self.first_chunk + len(self.keys))


@dataclass(frozen=True)
class SaveSpec:
    """Save chunk `chunk_index` of a request, which sits in `block_ids` (all of it, or the first
    blocks of a partial chunk), under `key`. `replaces`: partial keys of the same chunk holding a
    prefix of these tokens; once this is stored they are superseded, and deleted if present.
    `token_ids` (the chunk's tokens) and `parent` (the key of the chunk before it, None for a first)
    go with the put as hints for a kvstore-server's KV events (kvstore.token_hints)."""

    request_id: str
    key: str
    chunk_index: int
    block_ids: tuple[int, ...]
    partial: bool = False
    replaces: tuple[str, ...] = ()
    token_ids: tuple[int, ...] | None = None
    parent: str | None = None


@dataclass
class StepTransfers:
    """`preempt_saves`: trailing partial chunks of requests preempted while scheduling this step;
    their blocks are already free, so they are copied out before this step's loads and forward
    (`handle_preemptions`) can overwrite them. `saves` are copied out after the forward."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempt_saves: list[SaveSpec] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.loads and not self.saves and not self.preempt_saves
