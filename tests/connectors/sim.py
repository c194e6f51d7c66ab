"""A paged KV cache and block allocator driving a REAL connector pair the way the engine does.

No model: the "forward" of a step writes each new token's K/V from a fixed table (`truth_kv`), so
two requests that share a token prefix share that prefix's KV, and a loaded block can be compared
bit for bit with what a recompute would have written. The connectors, the store and the bytes they
move are all real.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from kvstore.connectors.base import KVConnectorRole
from kvstore.connectors.config import KVTransferConfig
from kvstore.connectors.kvstore import KVStoreConnector

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 3, 2, 64, 1000
BLOCK = 16


def make_config(dtype: str = "float32", **kw) -> KVTransferConfig:
    """The sim steps loads synchronously unless a test asks for `load_async=True`."""
    base = KVTransferConfig(**{"load_async": False, **kw})
    return base.for_engine(
        model_name="sim",
        model_config_hash="0" * 32,
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        kv_dtype=dtype,
        block_size=kw.get("block_size", BLOCK),
    )


_gen = torch.Generator().manual_seed(1234)
_TOKEN_KV = torch.randn(VOCAB, 2, LAYERS, KV_HEADS, HEAD_DIM, generator=_gen)
_POS_KV = torch.randn(8192, 2, LAYERS, KV_HEADS, HEAD_DIM, generator=_gen)


def truth_kv(tokens: list[int], lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """KV of positions lo..hi: `[2, L, hi-lo, H, D]`, a function of (token, position) only."""
    t = torch.as_tensor(tokens[lo:hi])
    kv = _TOKEN_KV[t] + _POS_KV[lo:hi]  # [n, 2, L, H, D]
    return kv.permute(1, 2, 0, 3, 4).to(dtype)


@dataclass(eq=False)
class Req:
    request_id: str
    prompt_token_ids: list[int]
    num_preemptions: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)


@dataclass
class Scheduled:
    seq: Req
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[Scheduled]


def prompt(n: int, seed: int, prefix: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    head = list(prefix or [])
    return head + [rng.randrange(VOCAB) for _ in range(n - len(head))]


class MiniEngine:
    def __init__(self, config: KVTransferConfig, num_blocks: int = 256, seed: int = 0) -> None:
        self.config = config
        self.bs = config.block_size
        self.dtype = getattr(torch, config.layout.kv_dtype)
        shape = (2, num_blocks, self.bs, KV_HEADS, HEAD_DIM)
        self.caches = [torch.zeros(shape, dtype=self.dtype) for _ in range(LAYERS)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # block tables are not contiguous, like a busy engine's
        self.scheduler = KVStoreConnector(KVConnectorRole.SCHEDULER, config)
        self.worker = KVStoreConnector(KVConnectorRole.WORKER, config)
        self.worker.register_kv_caches(self.caches)
        self.load_errors: set[int] = set()

    # -- scheduler side -------------------------------------------------------------------------
    def admit(self, req: Req, local_computed: int = 0, use_external: bool = True) -> int:
        ext, _ = self.scheduler.get_num_new_matched_tokens(req, local_computed)
        ext = ext if use_external else 0
        need = -(-len(req.all_token_ids) // self.bs) - len(req.block_table)
        req.block_table += [self.free.pop() for _ in range(need)]
        self.scheduler.update_state_after_alloc(req, req.block_table, ext)
        req.num_computed_tokens = local_computed + ext
        return ext

    def finish(self, req: Req) -> bool:
        delay, _ = self.scheduler.request_finished(req, req.block_table)
        return delay

    def preempt(self, req: Req) -> None:
        """The engine's preemption: the connector hears of it, then the blocks are free (the next
        allocation takes them first) and the request starts over."""
        self.scheduler.request_preempted(req, req.block_table)
        self.free += req.block_table[::-1]
        req.block_table, req.num_computed_tokens, req.num_preemptions = [], 0, req.num_preemptions + 1

    # -- one engine step: loads, forward (writes truth KV), saves --------------------------------
    def step(self, work: list[tuple[Req, int]]) -> set[int]:
        for r, n in work:  # blocks for the new tokens (a decode step may cross into a new block)
            need = -(-(r.num_computed_tokens + n) // self.bs) - len(r.block_table)
            r.block_table += [self.free.pop() for _ in range(max(0, need))]
        out = SchedulerOutput([Scheduled(r, n) for r, n in work])
        meta = self.scheduler.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.handle_preemptions()
        self.worker.start_load_kv()
        for layer in range(LAYERS):
            self.worker.wait_for_layer_load(layer)
            for r, n in work:
                lo = r.num_computed_tokens
                kv = truth_kv(r.all_token_ids, lo, lo + n, self.dtype)
                self.write(r, lo, lo + n, kv[:, layer : layer + 1], layers=[layer])
            self.worker.save_kv_layer(layer, self.caches[layer], None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        for r, n in work:
            r.num_computed_tokens += n
        errors = self.worker.get_block_ids_with_load_errors()
        self.load_errors |= errors
        return errors

    def prefill(self, req: Req, local_computed: int = 0) -> int:
        ext = self.admit(req, local_computed)
        self.step([(req, len(req.all_token_ids) - req.num_computed_tokens)])
        return ext

    # -- cache access by token position ---------------------------------------------------------
    def _slots(self, req: Req, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(lo, hi)
        blocks = torch.as_tensor(req.block_table)[pos // self.bs]
        return blocks, pos % self.bs

    def read(self, req: Req, lo: int, hi: int) -> torch.Tensor:
        blocks, offs = self._slots(req, lo, hi)
        return torch.stack([c[:, blocks, offs] for c in self.caches], dim=1)  # [2, L, n, H, D]

    def write(self, req: Req, lo: int, hi: int, kv: torch.Tensor, layers: list[int] | None = None) -> None:
        blocks, offs = self._slots(req, lo, hi)
        for i, layer in enumerate(layers if layers is not None else range(LAYERS)):
            self.caches[layer][:, blocks, offs] = kv[:, i]

    def shutdown(self) -> None:
        self.worker.flush()
        self.worker.shutdown()
        self.scheduler.shutdown()
