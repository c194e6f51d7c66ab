"""What the OpenAI routes share: the model check, tokenizing prompts and chats, running a request's
prompts through the engine, and the usage and logprobs of its outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from kvstore.engine.async_engine import AsyncEngine
from kvstore.engine.errors import InvalidRequest, ModelNotFound, TokenizerError
from kvstore.engine.llm_engine import LLMEngine
from kvstore.engine.openai_logprobs import LogprobsRenderer
from kvstore.engine.outputs import RequestOutput
from kvstore.engine.protocol import ChatCompletionRequest, TokenizeRequest


def check_model(engine: LLMEngine, model: str | None) -> None:
    if model is not None and model != engine.model_name:
        raise ModelNotFound(
            f"the model {str(model)[:100]!r} does not exist; this server serves {engine.model_name!r}",
            param="model",
        )


def usage_of(outs: list[RequestOutput], n: int = 1) -> dict:
    """`outs`: n choices per prompt, in order; a prompt counts once (as in OpenAI's and vLLM's usage)."""
    p = sum(len(o.prompt_token_ids) for o in outs[::n])
    c = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs[::n])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def completion_logprobs(renderer: LogprobsRenderer, out: RequestOutput, echo: bool = False) -> dict | None:
    lps = out.outputs[0].logprobs
    if lps is None:
        return None
    prompt = (out.prompt_token_ids, out.prompt_logprobs) if echo else None
    return renderer.completion(lps, prompt=prompt)


async def last_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async with aclosing(gen):
        async for item in gen:
            out = item
    assert out is not None and out.finished
    return out


def streams(aengine: AsyncEngine, prompts: list[list[int]], params: list, base_id: str) -> list:
    """One output stream per choice; a single one keeps the response's id as its request id."""
    if len(prompts) == 1:
        return [aengine.generate(prompts[0], params[0], base_id)]
    return [
        aengine.generate(p, sp, f"{base_id}-{i}")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]


async def generate_all(aengine: AsyncEngine, prompts: list[list[int]], params: list, base_id: str) -> list:
    """Every prompt of one request, at most `admission_window` of them in the engine at a time; the
    first failure cancels the rest (their requests are aborted)."""
    window = asyncio.Semaphore(aengine.admission_window)

    async def one(i: int) -> RequestOutput:
        async with window:
            return await last_output(aengine.generate(prompts[i], params[i], f"{base_id}-{i}"))

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def tokenize_completion_prompts(
    engine: LLMEngine, prompts: list, add_special_tokens: bool
) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = engine.tokenize(p, add_special_tokens)
        engine.check_prompt(ids)
        out.append(ids)
    return out


def render_chat(
    engine: LLMEngine, req: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool
) -> list[int]:
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
              if k not in ("messages", "add_generation_prompt", "bos_token", "eos_token", "tokenize")}  # fmt: skip
    try:
        text = engine.tokenizer.apply_chat_template(
            req.plain_messages(), add_generation_prompt=req.add_generation_prompt, **kwargs
        )
    except TokenizerError as e:
        raise InvalidRequest(str(e), param="messages") from e
    return engine.tokenize(text, add_special_tokens=add_special_tokens)


def tokenize_chat(engine: LLMEngine, req: ChatCompletionRequest) -> list[int]:
    ids = render_chat(engine, req, req.add_special_tokens)
    engine.check_prompt(ids)
    return ids
