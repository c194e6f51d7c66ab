"""The engine loop: requests in, one scheduled model step per `step()`, RequestOutputs out. The KV
connector's part of a step (making the connectors, finishing loads and saves) is `kv_transfer.py`."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
from kvstore.engine.block_manager import BlockManager
from kvstore.engine.config import ModelConfig, resolve_dtype
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.kv_cache.fp8_scales import KVScales, engine_kv_scales
from kvstore.engine.kv_cache.spec import resolve_kv_cache_dtype
from kvstore.engine.kv_events import EngineKVEvents
from kvstore.engine.kv_transfer import finish_kv_transfers, make_kv_connectors
from kvstore.engine.metrics import EngineMetrics
from kvstore.engine.model_runner import ModelRunner, kv_bytes_per_block
from kvstore.engine.outputs import CompletionOutput, RequestOutput
from kvstore.engine.sampling_params import SamplingParams
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.engine.sequence import Sequence, SequenceStatus
from kvstore.engine.structured_output.manager import StructuredOutputManager

from kvstore.events import parse_kv_events_config
from kvstore.keys import KVLayout, root_key

logger = logging.getLogger(__name__)
_MAX_DEFAULT_MODEL_LEN = 8192


def resolve_model_dir(model: str) -> Path:
    if model.lower() == "smollm2":
        from kvstore.engine.convert import ensure_smollm2

        return ensure_smollm2()
    return Path(model).expanduser()


def default_num_threads() -> int:
    """One intra-op thread. Measured on the 2-core dev box while other processes ran: with 2 threads
    every op waits at an OpenMP barrier for a descheduled thread (SmolLM2 batch-1 inter-token latency
    1.49 s with 2 threads vs 0.11 s with 1). Raise it with `num_threads` on a dedicated machine."""
    return 1


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        from kvstore.engine.loader import load_model
        from kvstore.engine.tokenizer import Tokenizer

        self.args = args
        torch.set_num_threads(args.num_threads or default_num_threads())
        self.model_dir = resolve_model_dir(args.model)
        self.device = torch.device(args.device)
        cfg = ModelConfig.from_pretrained(self.model_dir)
        self.dtype = resolve_dtype(args.dtype, cfg.dtype, self.device)
        self.max_model_len = args.max_model_len or min(cfg.max_position_embeddings, _MAX_DEFAULT_MODEL_LEN)
        if self.max_model_len > cfg.max_position_embeddings:
            raise InvalidRequest(
                f"max_model_len {self.max_model_len} exceeds the model's {cfg.max_position_embeddings} positions"
            )
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        events_config = parse_kv_events_config(args.kv_events_config)  # a bad one fails before the load
        fp8 = self.kv_cache_dtype == torch.float8_e4m3fn
        self.kv_scales: KVScales | None = None  # fp8: calibrated once, on a fixed text (kv_cache.fp8_scales)
        bs = args.block_size
        per_block = kv_bytes_per_block(
            cfg.num_hidden_layers, bs, cfg.num_key_value_heads, cfg.head_dim, self.kv_cache_dtype
        )
        num_blocks = args.num_kv_blocks or args.kv_cache_memory // per_block
        if num_blocks * bs < self.max_model_len:  # checked before the (slow) weight load
            raise InvalidRequest(
                f"a KV cache of {num_blocks} blocks x {bs} tokens cannot hold one sequence of max_model_len "
                f"{self.max_model_len}; give it more memory (kv_cache_memory) or lower max_model_len"
            )
        # Bad KV settings fail before the load; an fp8 cache's layout needs its scales, so it connects after.
        kv_scheduler, kv_worker = (
            (None, None) if fp8 else make_kv_connectors(args, cfg, self.kv_cache_dtype, self.kv_scales)
        )
        try:
            self.model, self.model_config = load_model(self.model_dir, self.dtype, self.device)
        except BaseException:
            for connector in (kv_worker, kv_scheduler):
                if connector is not None:
                    connector.shutdown()
            raise
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        cfg = self.model_config
        self.model_name = args.served_model_name or cfg.model_name
        if fp8:
            self.kv_scales = engine_kv_scales(self.model, self.tokenizer.encode, cfg.vocab_size,
                                              self.max_model_len - 1, args.kv_scale_granularity)  # fmt: skip
            kv_scheduler, kv_worker = make_kv_connectors(args, cfg, self.kv_cache_dtype, self.kv_scales)
        eos = set(cfg.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        self.structured_output = StructuredOutputManager(
            self.tokenizer.backend_tokenizer, cfg.vocab_size, eos, args.max_num_seqs
        )
        self.runner = ModelRunner(
            self.model, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs, num_blocks,
            self.kv_cache_dtype, self.device, kv_worker, self.kv_scales, structured_output=self.structured_output,
        )  # fmt: skip
        layout = KVLayout.for_model(
            cfg.raw, model=cfg.model_name, kv_dtype=str(self.kv_cache_dtype), chunk_size=bs,
            kv_scales=self.kv_scales.digest() if self.kv_scales is not None else "",
        )  # fmt: skip
        self.block_manager = BlockManager(num_blocks, bs, args.enable_prefix_caching, root_key(layout))
        self.kv_events = EngineKVEvents.create(events_config, self.block_manager)
        sched_cfg = SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(sched_cfg, self.block_manager, eos, kv_scheduler)
        self.runner.sampler.eos_token_ids = eos
        self.metrics = EngineMetrics(self.model_name)
        self.requests: dict[str, Sequence] = {}
        self._next_id = 0

    # ---- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt. A text that cannot fit (more characters than max_model_len tokens of
        the vocabulary's longest token could cover, vLLM's bound) is refused without tokenizing it."""
        if isinstance(prompt, str):
            limit = (self.max_model_len - 1) * self.tokenizer.max_chars_per_token
            if len(prompt) > limit:
                raise InvalidRequest(
                    f"the prompt has {len(prompt)} characters, more than the {limit} that "
                    f"{self.max_model_len - 1} tokens can hold (max_model_len {self.max_model_len})",
                    param="prompt",
                )
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidRequest("a prompt is a string or a list of token ids", param="prompt")
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request. `arrival_time` (time.monotonic()): when it reached the server, if earlier than
        now (a request that waited for a running step to end); TTFT and e2e latency count from it."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if self.scheduler.connector is not None and self.args.kv_producer and params.max_tokens != 1:
            params = dataclasses.replace(params, max_tokens=1, min_tokens=0)  # the decode side continues
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.check_request(token_ids, params)
        seq = Sequence(request_id, token_ids, params, prompt=prompt if isinstance(prompt, str) else None)
        if arrival_time is not None:
            seq.arrival_time = min(arrival_time, seq.arrival_time)
        if params.structured_outputs is not None:  # compiled (or a cache hit) before anything is queued
            seq.structured_output = self.structured_output.new_request(params.structured_outputs)
        self.requests[request_id] = seq
        self.scheduler.add_sequence(seq)
        self._update_gauges()
        return seq

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """What `add_request` refuses, checkable before anything is queued."""
        self.check_prompt(token_ids)
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        params.check_vocab(vocab)

    def check_prompt(self, token_ids: list[int]) -> None:
        """A prompt must leave one position for the first generated token."""
        if not token_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens; this model allows at most {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len}, one position is needed for the first generated token)",
                param="prompt",
            )

    def abort_request(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._release(seq, time.monotonic())
        self._update_gauges()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def render_metrics(self) -> bytes:
        """Prometheus text: the engine's metrics, then the KV connector's."""
        body = self.metrics.render()
        connector = self.scheduler.connector
        if connector is not None and getattr(connector, "metrics", None) is not None:
            body += connector.metrics.render(self.model_name)  # labelled with model_name, like ours
        return body

    def shutdown(self) -> None:
        """Wait for in-flight KV saves and close the store connection. Idempotent."""
        for connector in (self.runner.connector, self.scheduler.connector):
            if connector is not None:
                connector.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled model step. A fault inside it fails the requests it belongs to (a bad row in
        the sampler, a sequence whose detokenization raises) or, when that cannot be known (the model
        forward), every request of this step, each finished with `error` set; the others go on."""
        try:
            sched_out = self.scheduler.schedule()
        except Exception as e:  # the queues may be half-updated: nothing in them can be trusted
            logger.exception("scheduling failed")
            return self._fail(list(self.requests.values()), f"the engine's scheduler failed: {e!r}")
        outputs = [self.make_output(seq) for seq in sched_out.failed]
        for seq in sched_out.failed:
            self._release(seq, time.monotonic())
        if not sched_out.is_empty:
            outputs += self._run_scheduled(sched_out)
        elif self.runner.connector is not None:  # only loads to start (requests waiting for their KV)
            self.runner.execute_kv_transfers(sched_out.kv_connector_metadata)
        finish_kv_transfers(
            self.scheduler, self.runner, self.args.kv_producer, stepped=not sched_out.is_empty
        )
        if self.kv_events is not None:
            self.kv_events.flush()
        self._update_gauges()
        return outputs

    def _run_scheduled(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        started = time.monotonic()
        for sched in sched_out.scheduled:
            if sched.seq.first_scheduled_time is None:
                sched.seq.first_scheduled_time = started
        try:
            sampled = self.runner.execute_model(sched_out)
        except Exception as e:
            logger.exception("the model step failed for %d requests", len(sched_out.scheduled))
            return self._fail([s.seq for s in sched_out.scheduled], f"the model step failed: {e!r}")
        outputs = []
        errors = self.runner.sample_errors  # {request_id: exception}: rows the sampler pinned a fault on
        if errors:
            for sched in sched_out.scheduled:
                if sched.seq.request_id in errors:
                    outputs += self._fail([sched.seq], f"sampling failed: {errors[sched.seq.request_id]!r}")
            keep = [i for i, s in enumerate(sched_out.scheduled) if s.seq.request_id not in errors]
            sched_out.scheduled = [sched_out.scheduled[i] for i in keep]
            sampled = [sampled[i] for i in keep]
        for rid, (start, entries) in self.runner.prompt_logprobs.items():
            seq = self.requests.get(rid)
            if seq is not None and rid not in errors:
                if not seq.prompt_logprobs:
                    seq.prompt_logprobs = [None] * seq.num_prompt_tokens
                seq.prompt_logprobs[start + 1 : start + 1 + len(entries)] = entries
        now = time.monotonic()
        invalid = self.runner.invalid_block_ids
        logprobs = self.runner.sampler.logprobs
        for seq in self.scheduler.update_from_output(sched_out, sampled, invalid):
            if seq.sampling_params.logprobs is not None:
                entry = logprobs[seq.request_id]
                assert entry.token_id == seq.output_token_ids[-1]
                seq.output_logprobs.append(entry)
            try:
                self._on_new_token(seq, now)
            except Exception as e:
                logger.exception("%s: processing its new token failed", seq.request_id)
                outputs += self._fail([seq], f"processing the new token failed: {e!r}")
                continue
            outputs.append(self.make_output(seq))
        return outputs

    def _fail(self, seqs: list[Sequence], error: str) -> list[RequestOutput]:
        """Abort each sequence (freeing its blocks) with `error`; their final outputs."""
        outputs = []
        for seq in seqs:
            if seq.request_id not in self.requests:
                continue
            seq.error = error
            self.scheduler.abort(seq.request_id)
            self._release(seq, time.monotonic())
            outputs.append(self.make_output(seq))
        return outputs

    def _update_gauges(self) -> None:
        bm = self.block_manager
        self.metrics.update_scheduler_state(
            self.scheduler.num_running, self.scheduler.num_waiting, bm.usage,
            bm.prefix_cache_queries, bm.prefix_cache_hits, self.scheduler.num_preemptions,
        )  # fmt: skip

    def _on_new_token(self, seq: Sequence, now: float) -> None:
        m = self.metrics
        if seq.first_token_time is None:
            seq.first_token_time = now
            m.time_to_first_token.observe(now - seq.arrival_time)
            m.request_prefill_time.observe(now - (seq.first_scheduled_time or seq.arrival_time))
            m.request_prompt_tokens.observe(seq.num_prompt_tokens)
            m.request_prefill_kv_computed_tokens.observe(seq.num_prompt_tokens - seq.num_cached_tokens)
            m.prompt_tokens.inc(seq.num_prompt_tokens)
        else:
            m.inter_token_latency.observe(now - seq.last_token_time)
        seq.last_token_time = now
        m.generation_tokens.inc()
        self._detokenize(seq)
        if seq.is_finished:
            self._release(seq, now)

    def _detokenize(self, seq: Sequence) -> None:
        p = seq.sampling_params
        if seq.is_finished:  # the exact full decode, a trailing incomplete character included
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
            seq.detokenizer = None
        else:
            if seq.detokenizer is None:
                seq.detokenizer = self.tokenizer.incremental_decoder(p.skip_special_tokens)
            text = seq.detokenizer.update(seq.output_token_ids)
        if p.stop:
            # Only the tail can hold a new match: earlier text was checked in earlier steps.
            start = max(0, len(seq.output_text) - max(len(s) for s in p.stop))
            hits = [(i, s) for s in p.stop if (i := text.find(s, start)) != -1]
            if hits:
                index, stop = min(hits)
                text = text[: index + len(stop)] if p.include_stop_str_in_output else text[:index]
                seq.stop_reason = stop
                if seq.is_finished:
                    seq.status = SequenceStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        seq.output_text = text

    def _release(self, seq: Sequence, now: float) -> None:
        seq.finished_time = now
        self.requests.pop(seq.request_id, None)
        self.runner.sampler.release(seq.request_id)
        seq.structured_output = None  # the matcher is done; free it now
        seq.detokenizer = None
        if seq.status is not SequenceStatus.FINISHED_ABORTED:
            self.metrics.e2e_request_latency.observe(now - seq.arrival_time)
            self.metrics.request_success.inc()

    def make_output(self, seq: Sequence) -> RequestOutput:
        metrics = {"arrival_time": seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["time_to_first_token"] = seq.first_token_time - seq.arrival_time
        if seq.finished_time is not None:
            metrics["e2e_latency"] = seq.finished_time - seq.arrival_time
        logprobs = list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None
        completion = CompletionOutput(
            0, seq.output_text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason, logprobs
        )
        prompt_logprobs = None
        if seq.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = list(seq.prompt_logprobs or [None] * seq.num_prompt_tokens)
        return RequestOutput(
            seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion], seq.is_finished,
            seq.num_cached_tokens, metrics, seq.error, prompt_logprobs,
        )  # fmt: skip
