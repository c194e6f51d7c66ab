"""Output-token logprobs in OpenAI's two shapes: chat (`logprobs.content`, one entry per token with
its `top_logprobs`) and completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); and
vLLM's `prompt_logprobs` (per prompt token: null for the first, else {token id: {logprob, rank,
decoded_token}} for the token itself and the top ones).

A token's text is its own decode (special tokens shown), as in vLLM: a token that holds only part
of a UTF-8 character reads U+FFFD. Log-probabilities are clamped at -9999.0 as in vLLM, since JSON
has no -inf (a token masked by a grammar or a logit bias)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.engine.outputs import TokenLogprobs
from kvstore.engine.tokenizer import Tokenizer

_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > _FLOOR else _FLOOR  # NaN (a row with every token masked) too


class LogprobsRenderer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            if len(self._text) > 65536:
                self._text.clear()
            text = self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict:
        return {
            "content": [
                {
                    **self._entry(e.token_id, e.logprob),
                    "top_logprobs": [self._entry(t, lp) for t, lp in e.top],
                }
                for e in entries
            ]
        }

    def completion(
        self,
        entries: Sequence[TokenLogprobs],
        text_offset: int = 0,
        prompt: tuple[Sequence[int], Sequence[TokenLogprobs | None]] | None = None,
    ) -> dict:
        """`text_offset`: where the first of these tokens starts in the completion's text (a stream
        continues from the previous chunk's end). `prompt` (`echo`): the prompt's ids and logprobs go
        first, the first token's as null (nothing predicts it), as in vLLM."""
        ids = [e.token_id for e in entries]
        scored: list[TokenLogprobs | None] = list(entries)
        if prompt is not None:
            ids, scored = [*prompt[0], *ids], [*prompt[1], *scored]
        tokens, offsets = [], []
        for t in ids:
            offsets.append(text_offset)
            tokens.append(self.token_text(t))
            text_offset += len(tokens[-1])
        top = [
            None
            if e is None
            else {**{self.token_text(t): _lp(lp) for t, lp in e.top}, tokens[i]: _lp(e.logprob)}
            for i, e in enumerate(scored)
        ]
        return {"tokens": tokens, "token_logprobs": [None if e is None else _lp(e.logprob) for e in scored],
                "top_logprobs": top, "text_offset": offsets}  # fmt: skip

    def vllm_prompt(self, entries: Sequence[TokenLogprobs | None]) -> list[dict | None]:
        out: list[dict | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            scores = {str(t): {"logprob": _lp(lp), "rank": r, "decoded_token": self.token_text(t)}
                      for r, (t, lp) in enumerate(e.top, start=1)}  # fmt: skip
            scores[str(e.token_id)] = {"logprob": _lp(e.logprob), "rank": e.rank,
                                       "decoded_token": self.token_text(e.token_id)}  # fmt: skip
            out.append(scores)
        return out
