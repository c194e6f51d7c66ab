"""Next-token sampling: logit bias, min_tokens, repetition / frequency / presence penalties, greedy,
temperature, min-p, top-k, top-p, per-request seeds (vLLM's order: the first three steer greedy too).

A request with a seed owns a `torch.Generator` seeded once, so its tokens do not depend on what else
is in the batch. Sampling uses the exponential race (argmax of p / Exp(1) noise), which draws from
`p` exactly and lets each row use its own generator.

`sample_isolated` is what the engine calls: when the batched call raises, the generators are put back
and every row is sampled alone, so that a fault that belongs to one request fails that request only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from kvstore.engine.outputs import TokenLogprobs
from kvstore.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
TokenHistory = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, output token ids) of one row


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus. top_k <= 0: no limit."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    mask = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass before it is < top_p; the first token always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before >= top_p.unsqueeze(1)
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens whose probability is below min_p times the row's most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_penalties(
    logits: torch.Tensor, history: list[TokenHistory], params: list[SamplingParams]
) -> torch.Tensor:
    """vLLM's (and OpenAI's) penalties. Repetition: a token seen in the prompt or the output has its
    logit divided by the penalty when positive, multiplied when negative. Frequency and presence:
    minus penalty x (count in the output) and minus penalty x (seen in the output)."""
    n, vocab = logits.shape
    dev = logits.device
    counts = torch.zeros(n, vocab, device=dev)
    in_prompt = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    for row, (prompt, output) in enumerate(history):
        if output:
            counts[row] = torch.bincount(torch.tensor(output, device=dev), minlength=vocab)[:vocab].float()
        in_prompt[row, torch.tensor(prompt, dtype=torch.long, device=dev)] = True
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev).unsqueeze(1)
    rep = torch.where(in_prompt | (counts > 0), rep, torch.ones_like(rep))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], device=dev).unsqueeze(1)
    return logits - freq * counts - presence * (counts > 0).float()


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], top: Sequence[int], with_rank: bool = False
) -> list[TokenLogprobs]:
    """Per row of raw `logits`: the log-probability of `tokens[i]`, its `top[i]` most likely tokens'
    and, `with_rank`, the token's rank (1 = most likely)."""
    lps = logits.log_softmax(dim=-1)
    chosen = lps.gather(1, torch.tensor(tokens, device=lps.device).unsqueeze(1))
    ranks = ((lps > chosen).sum(dim=1) + 1).tolist() if with_rank else [None] * len(tokens)
    k = max(top)
    top_lp, top_ids = lps.topk(k, dim=-1) if k else (lps[:, :0], lps[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(t, lp, tuple(zip(top_ids[j][: top[j]], top_lp[j][: top[j]], strict=True)), ranks[j])
        for j, (t, lp) in enumerate(zip(tokens, chosen.squeeze(1).tolist(), strict=True))
    ]


class Sampler:
    def __init__(self, eos_token_ids: set[int] | None = None) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self.logprobs: dict[str, TokenLogprobs] = {}  # request id -> its sampled token's, this step
        self.eos_token_ids = set(eos_token_ids or ())  # banned, with stop_token_ids, before min_tokens

    def generator_for(
        self, request_id: str, params: SamplingParams, device: torch.device
    ) -> torch.Generator | None:
        if params.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        history: list[TokenHistory] | None = None,
    ) -> list[int]:
        """logits [n, vocab] -> one token id per row. `history` (prompt, output token ids) per row is
        needed only when a row has penalties."""
        assert logits.shape[0] == len(params) == len(request_ids)
        logits = raw = logits.float()  # `raw` is never written to: processing works on copies
        dev = logits.device
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        early = [i for i, p in enumerate(params) if p.min_tokens and history is not None
                 and len(history[i][1]) < p.min_tokens]  # fmt: skip
        if biased or early:
            logits = logits.clone()
        for i in biased:
            ids = torch.tensor(list(params[i].logit_bias), dtype=torch.long, device=dev)
            logits[i, ids] += torch.tensor(list(params[i].logit_bias.values()), device=dev)
        for i in early:  # vLLM's min_tokens: no stop token before that many output tokens
            p = params[i]
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            if banned:
                logits[i, torch.tensor(sorted(banned), dtype=torch.long, device=dev)] = float("-inf")
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        if penalized:
            assert history is not None, "penalties need each row's prompt and output token ids"
            idx = torch.tensor(penalized, device=dev)
            logits = logits.index_copy(
                0, idx, apply_penalties(logits[idx], [history[i] for i in penalized], [params[i] for i in penalized])
            )  # fmt: skip
        out = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=dev)
            sub = logits[idx] / torch.tensor([params[i].temperature for i in rows], device=dev).unsqueeze(1)
            if any(params[i].min_p > 0 for i in rows):
                sub = apply_min_p(sub, torch.tensor([params[i].min_p for i in rows], device=dev))
            if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in rows):
                top_k = torch.tensor([params[i].top_k for i in rows], device=dev)
                top_p = torch.tensor([params[i].top_p for i in rows], device=dev, dtype=sub.dtype)
                sub = apply_top_k_top_p(sub, top_k, top_p)
            probs = sub.softmax(dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(rows):
                gen = self.generator_for(request_ids[i], params[i], dev)
                noise[j].exponential_(generator=gen)
            out[idx] = (probs / noise).argmax(dim=-1)
        tokens = out.tolist()
        self._record_logprobs(raw, tokens, request_ids, params)
        return tokens

    def _record_logprobs(
        self, raw: torch.Tensor, tokens: list[int], request_ids: list[str], params: list[SamplingParams]
    ) -> None:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return
        entries = token_logprobs(
            raw[torch.tensor(rows, device=raw.device)],
            [tokens[i] for i in rows],
            [params[i].logprobs for i in rows],
        )
        for i, entry in zip(rows, entries, strict=True):
            self.logprobs[request_ids[i]] = entry

    def sample_isolated(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        history: list[TokenHistory] | None = None,
    ) -> tuple[list[int | None], dict[int, Exception]]:
        """Like `__call__`, but a failure is pinned on the rows it belongs to: (tokens with None for a
        failed row, {row: exception}). Seeded rows draw the same tokens as if nothing had failed."""
        self.logprobs = {}
        saved = {rid: g.get_state() for rid, g in self._generators.items() if rid in set(request_ids)}
        try:
            return list(self(logits, request_ids, params, history)), {}
        except Exception as batch_error:  # find the rows it belongs to
            logger.warning(
                "batched sampling failed (%r); sampling the %d rows one by one", batch_error, len(params)
            )
        for rid in request_ids:  # back to the state before the failed call
            if rid in saved:
                self._generators[rid].set_state(saved[rid])
            else:
                self._generators.pop(rid, None)
        tokens: list[int | None] = []
        errors: dict[int, Exception] = {}
        for i, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            try:
                tokens.append(
                    self(logits[i : i + 1], [rid], [p], None if history is None else [history[i]])[0]
                )
            except Exception as e:
                tokens.append(None)
                errors[i] = e
        return tokens, errors
