"""A request's prompt tokens as the engines compute them (the same tokenizer and chat template), and
their chunk keys as the engines' KV connector stores them (kvstore.keys with the same layout)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from kvstore.engine.config import ModelConfig, resolve_dtype
from kvstore.engine.errors import TokenizerError
from kvstore.engine.kv_cache.spec import resolve_kv_cache_dtype
from kvstore.engine.protocol import ChatCompletionRequest, CompletionRequest
from kvstore.engine.tokenizer import Tokenizer
from pydantic import ValidationError

from kvstore.keys import KVLayout, hash_block, model_layout, root_key

logger = logging.getLogger(__name__)


class PromptTokens:
    def __init__(
        self,
        model_dir: Path,
        chunk_size: int = 256,
        namespace: str = "",
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
    ) -> None:
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

    def of_completion(self, body: dict[str, Any]) -> list[int] | None:
        """The first prompt's tokens; None when the body is not one the router can read (the engine will
        say what is wrong with it)."""
        try:
            req = CompletionRequest.model_validate(body)
            prompt = req.prompts()[0]
        except (ValidationError, IndexError, ValueError):
            return None
        if isinstance(prompt, list):
            return list(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)

    def of_chat(self, body: dict[str, Any]) -> list[int] | None:
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
        return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
