"""The tokenizer of an HF model directory: `tokenizer.json` through the `tokenizers` package, the chat
template from `tokenizer_config.json` rendered with jinja2 (as transformers does), and the stop ids."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kvstore.engine.errors import TokenizerError


def _special_token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class IncrementalDecoder:
    """The text of a growing list of output ids at O(1) per token (`tokenizers`' DecodeStream, as in
    vLLM V1; decoding all ids again on every token costs O(n) each: 0.5 ms at 4,096 tokens, per
    sequence per step). `text` only ever grows and holds whole characters: a token that ends inside
    a UTF-8 character waits for the next one, so `text` is a prefix of the final text."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._num_ids = 0
        self.text = ""

    def update(self, ids: Sequence[int]) -> str:
        """`ids`: all output ids so far (the ones already seen are skipped)."""
        assert len(ids) >= self._num_ids, "output ids only grow"
        for i in ids[self._num_ids :]:
            piece = self._stream.step(self._tok, i)
            if piece:
                self.text += piece
        self._num_ids = len(ids)
        return self.text


class Tokenizer:
    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        eos = [tokenizer.token_to_id(eos_token)] if eos_token else []
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in [*eos, *extra_eos_token_ids] if i is not None)
        )
        self._template = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir} has no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load {path}: {e}") from e
        config: dict[str, Any] = {}
        if (model_dir / "tokenizer_config.json").is_file():
            try:
                config = json.loads((model_dir / "tokenizer_config.json").read_text())
            except (OSError, ValueError) as e:
                raise TokenizerError(f"cannot read {model_dir / 'tokenizer_config.json'}: {e}") from e
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        extra_eos: list[int] = []
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            try:
                eos = json.loads(gen_path.read_text()).get("eos_token_id")
            except (OSError, ValueError) as e:
                raise TokenizerError(f"cannot read {gen_path}: {e}") from e
            extra_eos = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            tok,
            chat_template=template,
            bos_token=_special_token_text(config.get("bos_token")),
            eos_token=_special_token_text(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            extra_eos_token_ids=extra_eos,
        )

    @property
    def backend_tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` underneath (transformers' name for it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The longest token's length in characters: a text of n characters holds at least
        n / max_chars_per_token tokens (vLLM's bound for refusing over-long prompts untokenized)."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self._tok, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` ([{"role", "content"}, ...]) with the model's chat template; with
        `tokenize=True` return token ids (the template already holds the special tokens)."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise TokenizerError(f"a chat message needs 'role' and 'content', got {m!r}")
        import jinja2

        try:
            text = self._compiled_template().render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"cannot render the chat template: {e}") from e
        if tokenize:
            return self._tok.encode(text, add_special_tokens=False).ids
        return text

    def _compiled_template(self):
        if self._template is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str):
                raise TokenizerError(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader()
            )
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
                x, indent=indent, ensure_ascii=False
            )
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"cannot compile the chat template: {e}") from e
        return self._template
