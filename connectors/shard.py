"""Which part of a stored chunk one worker's paged cache holds, under tensor and pipeline parallelism.

Stored chunks are TP-free (docs/design.md §5, "Parallel engines"): a chunk is `[2, L, T, H, D]` with
every KV head, exactly what a TP=1 engine stores under the same key, so it loads at any TP size and
into `kvstore-engine`. Under TP each rank's cache holds the heads vLLM gives it: with H heads over n
ranks, rank r holds heads `[r*H/n, (r+1)*H/n)`; with more ranks than heads (n = k*H) rank r holds
head `r // k` (vLLM replicates each KV head on k consecutive ranks). A load reads only those heads of
the blob (a strided view of the leased blob: no copy of the other heads); a save gathers the chunk's
heads from every rank to TP rank 0 (one collective per step), which stores the whole chunk.

An MLA cache (`replicated`) holds the same latent on every rank: stored once, by TP rank 0, whatever
the TP size; every rank loads all of it. Under PP a stage's cache holds layers `[a, b)`: its chunks
are stored under keys derived from the chunk keys and that layer range (`kvstore.keys.stage_key`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import InvalidArgument


@dataclass(frozen=True)
class Shard:
    tp_rank: int = 0
    tp_size: int = 1
    num_heads: int = 0  # KV heads of a stored chunk (the model's); 0: whatever the cache holds
    replicated: bool = False  # every rank holds all of it (MLA's latent)
    group: Any = None  # the TP group's torch.distributed process group (saves gather over it)
    layers: tuple[int, int] | None = None  # PP: this stage's layers [a, b) of the model; None: all

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        h, n = self.num_heads, self.tp_size
        if h and n > 1 and not self.replicated and (h % n if n <= h else n % h):
            raise InvalidArgument(f"{h} KV heads cannot be split over {n} ranks")

    @property
    def heads(self) -> tuple[int, int] | None:
        """This rank's heads [h0, h1) of a stored chunk, or None when it holds all of them."""
        h, n, r = self.num_heads, self.tp_size, self.tp_rank
        if n == 1 or self.replicated or not h:
            return None
        if n <= h:
            per = h // n
            return r * per, (r + 1) * per
        head = r // (n // h)
        return head, head + 1

    @property
    def local_heads(self) -> int:
        span = self.heads
        return span[1] - span[0] if span else self.num_heads

    @property
    def stores(self) -> bool:
        """Whether this rank stores chunks (TP rank 0 does, for every rank)."""
        return self.tp_rank == 0

    @property
    def gathers(self) -> bool:
        """Whether saves gather heads from every rank first (the heads are split)."""
        return self.heads is not None

    def contributors(self) -> list[int]:
        """The ranks whose heads make up a stored chunk, in head order (one per head range)."""
        h, n = self.num_heads, self.tp_size
        return list(range(n)) if n <= h else list(range(0, n, n // h))


def carve(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Contiguous tensors of `shapes`, one after the other in the 1-D `flat`."""
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[at : at + n].view(shape))
        at += n
    return out


def gather_to_first(flat: torch.Tensor, shard: Shard) -> list[torch.Tensor] | None:
    """Every TP rank's `flat` (1-D, the same size on every rank), in rank order, on TP rank 0; None on
    the others. One collective: every rank of the group calls it for the same step."""
    import torch.distributed as dist  # noqa: PLC0415

    wire = flat.view(torch.uint8)  # a collective moves bytes: any dtype (bf16, fp8) goes
    parts = [torch.empty_like(wire) for _ in range(shard.tp_size)] if shard.stores else None
    dist.gather(wire, parts, group=shard.group, group_dst=0)
    return None if parts is None else [p.view(flat.dtype) for p in parts]
