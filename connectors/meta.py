"""What the scheduler-side connector tells the worker-side one each step (inside
`KVConnectorMetadata.payload`): which store chunks to load into which blocks, which to save."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadSpec:
    """Fill tokens `[start_token, end_token)` of a request from the store.

    `keys[i]` is chunk `first_chunk + i`; `block_ids` is the request's block table (at least up to
    `end_token`). Both token bounds are block-aligned.
    """

    request_id: str
    keys: tuple[str, ...]
    first_chunk: int
    block_ids: tuple[int, ...]
    start_token: int
    end_token: int

    def chunk_indices(self) -> range:
        return range(self.first_chunk, self.first_chunk + len(self.keys))


@dataclass(frozen=True)
class SaveSpec:
    """Save full chunk `chunk_index` of a request, which sits in `block_ids`, under `key`."""

    request_id: str
    key: str
    chunk_index: int
    block_ids: tuple[int, ...]


@dataclass
class StepTransfers:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.loads and not self.saves
