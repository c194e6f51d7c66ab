"""A request's prompt tokens as the engines compute them (the same tokenizer and chat template), and
their chunk keys as the engines' KV connector stores them (kvstore.keys with the same layout).

The router routes on a prompt's leading `route_tokens` tokens only (`Prompt`): a prefix match past
them changes no decision worth the work, and a text is tokenized only as far as it takes to get them
(`CHARS_PER_TOKEN` characters a token), so a prompt of megabytes costs what one of kilobytes does. Its
length is then estimated from its characters. Token ids outside [0, 2^31) are a 400 here, before any
work (the keys hash them as 32-bit integers)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch
from kvstore.engine.config import ModelConfig, resolve_dtype
from kvstore.engine.errors import InvalidRequest, TokenizerError
from kvstore.engine.kv_cache.spec import resolve_kv_cache_dtype
from kvstore.engine.protocol import ChatCompletionRequest, CompletionRequest
from kvstore.engine.router import ROUTE_TOKENS
from kvstore.engine.tokenizer import Tokenizer
from pydantic import ValidationError

from kvstore.keys import KVLayout, hash_block, model_layout, root_key

logger = logging.getLogger(__name__)
CHARS_PER_TOKEN = 8  # a text is tokenized up to route_tokens x this many characters
CUT_TAIL = 8  # tokens dropped at the end of a cut text: the cut may have split a word
MAX_TOKEN_ID = 2**31


class Prompt(NamedTuple):
    tokens: list[int]  # its leading tokens (at most route_tokens), as the engine computes them
    total: int  # its length in tokens (estimated from its characters when the text was cut)


def check_token_ids(prompt: Any) -> None:
    """InvalidRequest (400) when `prompt` holds token ids outside [0, 2^31), in any of its prompts."""
    lists = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    for ids in lists:
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            continue  # text, or not token ids: the engine's validation says what is wrong with it
        if min(ids) < 0 or max(ids) >= MAX_TOKEN_ID:
            raise InvalidRequest(f"prompt token ids must be in [0, {MAX_TOKEN_ID})", param="prompt")


class PromptTokens:
    def __init__(
        self,
        model_dir: Path,
        chunk_size: int = 256,
        namespace: str = "",
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        route_tokens: int = ROUTE_TOKENS,
    ) -> None:
        self.route_tokens = route_tokens
        cfg = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        kv_dtype = resolve_kv_cache_dtype(
            kv_cache_dtype, resolve_dtype(dtype, cfg.dtype, torch.device("cpu"))
        )
        fields = model_layout(cfg.raw, model=cfg.model_name, kv_dtype=str(kv_dtype))
        self.chunk_size = chunk_size
        self.root = root_key(KVLayout(**fields, chunk_size=chunk_size), namespace)

    def chunk_keys(self, token_ids: list[int]) -> list[bytes]:
        """Keys of the full chunks before the last prompt token (which is always recomputed)."""
        n, parent, keys = self.chunk_size, self.root, []
        for i in range((len(token_ids) - 1) // n):
            parent = hash_block(parent, token_ids[i * n : (i + 1) * n])
            keys.append(parent)
        return keys

    def of_completion(self, body: dict[str, Any]) -> Prompt | None:
        """The first prompt's leading tokens; None when the body is not one the router can read (the engine
        will say what is wrong with it). InvalidRequest for token ids out of range."""
        raw = body.get("prompt")
        check_token_ids(raw)
        first = raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], (str, list)) else raw
        total = len(first) if isinstance(first, list) else 0
        try:  # validated with the first prompt only, its ids cut to those routed on
            cut = first[: self.route_tokens] if isinstance(first, list) else first
            req = CompletionRequest.model_validate({**body, "prompt": cut})
            prompt = req.prompts()[0]
        except (ValidationError, IndexError, ValueError):
            return None
        if isinstance(prompt, list):
            return Prompt(list(prompt), total)
        return self._leading(prompt, req.add_special_tokens)

    def of_chat(self, body: dict[str, Any]) -> Prompt | None:
        try:
            req = ChatCompletionRequest.model_validate(body)
            kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
                      if k not in ("messages", "add_generation_prompt", "bos_token", "eos_token", "tokenize")}  # fmt: skip
            text = self.tokenizer.apply_chat_template(
                req.plain_messages(), add_generation_prompt=req.add_generation_prompt, **kwargs
            )
        except (ValidationError, TokenizerError, ValueError) as e:
            logger.debug("routing a chat request without its tokens: %s", e)
            return None
        return self._leading(text, req.add_special_tokens)

    def _leading(self, text: str, add_special_tokens: bool) -> Prompt:
        """`text`'s leading tokens, tokenizing no more of it than they take."""
        cut = self.route_tokens * CHARS_PER_TOKEN
        if len(text) <= cut:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return Prompt(ids[: self.route_tokens], len(ids))
        ids = self.tokenizer.encode(text[:cut], add_special_tokens=add_special_tokens)
        total = max(len(ids), round(len(ids) * len(text) / cut))
        return Prompt(ids[: min(self.route_tokens, max(len(ids) - CUT_TAIL, 1))], total)
