"""The offline API: `LLM(model_dir, **engine_args).generate(prompts, SamplingParams)`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.errors import InvalidRequest, RequestFailed
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.outputs import RequestOutput
from kvstore.engine.sampling_params import SamplingParams
from tqdm import tqdm

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "smollm2", **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=str(model), **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs in prompt order.

        A prompt is a string or a list of token ids. Bad input raises InvalidRequest before anything
        is scheduled, so one bad prompt does not leave the others half-run.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(params)} sampling params")
        for p in prompts:  # validate everything before the first request is queued
            self._check_prompt(p)
        for sp in params:  # and compile every constraint (a bad one raises InvalidRequest here)
            if isinstance(sp, SamplingParams) and sp.structured_outputs is not None:
                self.engine.structured_output.compile(sp.structured_outputs)
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(prompt, sp).request_id)
        except BaseException:
            for rid in ids:  # all or nothing: no orphan keeps running after a bad prompt
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | Seq[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, via the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenizer.apply_chat_template(c, tokenize=True) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _check_prompt(self, prompt: Prompt) -> None:
        self.engine.check_prompt(self.engine.tokenize(prompt))

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while len(done) < len(request_ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        if out.error is not None:
                            raise RequestFailed(f"request {out.request_id} failed: {out.error}")
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in wanted - done.keys():
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in request_ids]

    def shutdown(self) -> None:
        """Wait for in-flight KV saves to the store and close its connection. Idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
