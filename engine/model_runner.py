"""Runs one scheduled step: builds the varlen-paged inputs, calls the model, samples.

The KV cache is ONE tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` in the
KV cache dtype (`--kv-cache-dtype`); each attention module's `kv_cache` is a view of its layer (the
store connector reads and writes blocks through the same views), and with an fp8 cache its
`k_scale`/`v_scale` are that layer's scales.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from kvstore.connectors.base import KVConnectorBase
from kvstore.engine.attention_metadata import AttentionMetadata
from kvstore.engine.errors import EngineError
from kvstore.engine.kv_cache.fp8_scales import KVScales
from kvstore.engine.layers.huge_pages import zeros_huge_pages
from kvstore.engine.outputs import TokenLogprobs
from kvstore.engine.sampler import Sampler, token_logprobs
from kvstore.engine.scheduler import ScheduledSequence, SchedulerOutput
from kvstore.engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        connector: KVConnectorBase | None = None,
        kv_scales: KVScales | None = None,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.sampler = Sampler()
        self.structured_output = structured_output  # masks the logits of grammar-constrained rows
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        try:
            if device.type == "cpu":  # decode attention reads its blocks scattered over the cache
                self.kv_cache = zeros_huge_pages(shape, dtype)
            else:
                self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError, OSError) as e:  # OSError: the huge-page mmap
            raise EngineError(f"cannot allocate a KV cache of {num_blocks} blocks: {e}") from e
        attn_modules = [m for m in model.modules() if hasattr(m, "kv_cache")]
        if len(attn_modules) != num_layers:
            raise EngineError(
                f"found {len(attn_modules)} attention modules with a kv_cache, expected {num_layers}"
            )
        if (dtype == torch.float8_e4m3fn) != (kv_scales is not None):
            raise EngineError("an fp8 KV cache needs scales, and only an fp8 cache takes them")
        for layer, module in enumerate(attn_modules):
            module.kv_cache = self.kv_cache[layer]
            if kv_scales is not None:
                module.k_scale = kv_scales.scales[layer, 0].to(device).contiguous()
                module.v_scale = kv_scales.scales[layer, 1].to(device).contiguous()
        self.connector = connector  # worker side of the KV connector (--kv-backend), or None
        self.invalid_block_ids: set[int] = set()  # blocks whose KV failed to load in the last step
        self.sample_errors: dict[str, Exception] = {}  # requests the sampler failed in the last step
        # request id -> (first prompt position, logprobs of the tokens after it), the last step's
        self.prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        if connector is not None:
            connector.register_kv_caches([self.kv_cache[layer] for layer in range(num_layers)])
        logger.info(
            "KV cache: %d blocks x %d tokens, %s, %.1f MiB",
            num_blocks,
            block_size,
            str(dtype).removeprefix("torch."),
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
        )

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions = []
        slots = []
        cu_seqlens = [0]
        context_lens = []
        max_blocks = max(len(s.seq.block_table) for s in out.scheduled)
        block_tables = np.full((len(out.scheduled), max_blocks), -1, dtype=np.int32)
        for i, sched in enumerate(out.scheduled):
            seq = sched.seq
            start = seq.num_computed_tokens
            end = start + sched.num_new_tokens
            input_ids.extend(seq.all_token_ids[start:end])
            table = np.asarray(seq.block_table, dtype=np.int64)
            block_tables[i, : len(table)] = table
            pos = np.arange(start, end, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu_seqlens.append(cu_seqlens[-1] + sched.num_new_tokens)
            context_lens.append(end)
        dev = self.device
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_q_len=max(s.num_new_tokens for s in out.scheduled),
            max_context_len=max(context_lens),
            block_size=bs,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        return ids, torch.from_numpy(np.concatenate(positions)).to(dev), meta

    def execute_kv_transfers(self, kv_connector_metadata: object) -> None:
        """A step without a forward: start this step's loads and saves (vLLM's kv_connector_no_forward)."""
        connector = self.connector
        assert connector is not None
        connector.bind_connector_metadata(kv_connector_metadata)
        connector.handle_preemptions()
        connector.start_load_kv()
        connector.wait_for_save()
        self.invalid_block_ids = connector.get_block_ids_with_load_errors()
        connector.clear_connector_metadata()

    _PROMPT_LOGITS_ROWS = 128  # logits of this many positions at a time (fp32 x vocab each)

    def _prompt_logprobs(self, sched: ScheduledSequence, hidden: torch.Tensor, first_row: int) -> None:
        """Logprobs of the prompt tokens this chunk predicts: position p's logits score token p + 1.
        The last prompt position predicts the first output token: that is the sample, not this."""
        seq, start = sched.seq, sched.seq.num_computed_tokens
        end = min(start + sched.num_new_tokens, seq.num_prompt_tokens - 1)
        if end <= start:
            return
        k = seq.sampling_params.prompt_logprobs
        entries: list[TokenLogprobs] = []
        for lo in range(start, end, self._PROMPT_LOGITS_ROWS):
            hi = min(lo + self._PROMPT_LOGITS_ROWS, end)
            logits = self.model.compute_logits(hidden[first_row + lo - start : first_row + hi - start])
            entries += token_logprobs(
                logits, seq.prompt_token_ids[lo + 1 : hi + 1], [k] * (hi - lo), with_rank=True
            )
        self.prompt_logprobs[seq.request_id] = (start, entries)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> list[int | None]:
        """One forward over every scheduled token; a token for each sequence whose chunk ends it."""
        assert not out.is_empty
        self.sample_errors = {}
        input_ids, positions, meta = self.prepare_inputs(out)
        connector = self.connector
        if connector is not None:  # load this step's external KV into its blocks before the forward
            connector.bind_connector_metadata(out.kv_connector_metadata)
            connector.handle_preemptions()  # blocks freed by this step's preemptions, before reuse
            connector.start_load_kv()
            for layer in range(self.kv_cache.shape[0]):
                connector.wait_for_layer_load(layer)
        hidden = self.model(input_ids, positions, meta)
        if connector is not None:  # save newly full chunks; after wait_for_save the blocks may change
            for layer in range(self.kv_cache.shape[0]):
                connector.save_kv_layer(layer, self.kv_cache[layer], meta)
            connector.wait_for_save()
            self.invalid_block_ids = connector.get_block_ids_with_load_errors()
            connector.clear_connector_metadata()
        self.prompt_logprobs = {}
        for i, s in enumerate(out.scheduled):
            if s.seq.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden, int(meta.cu_seqlens_q[i]))
        rows = [i for i, s in enumerate(out.scheduled) if s.samples]
        sampled: list[int | None] = [None] * len(out.scheduled)
        if rows:
            last = meta.cu_seqlens_q[1:].long() - 1
            logits = self.model.compute_logits(hidden[last[rows]])
            seqs = [out.scheduled[i].seq for i in rows]
            grammar_errors = {}
            if self.structured_output is not None:
                grammar_errors = self.structured_output.apply_grammar_bitmask(
                    logits, [s.structured_output for s in seqs]
                )
            tokens, errors = self.sampler.sample_isolated(
                logits, [s.request_id for s in seqs], [s.sampling_params for s in seqs],
                [(s.prompt_token_ids, s.output_token_ids) for s in seqs],
            )  # fmt: skip
            for i, tok in zip(rows, tokens, strict=True):
                sampled[i] = tok
            errors.update(grammar_errors)
            self.sample_errors = {seqs[j].request_id: e for j, e in errors.items()}
        return sampled
