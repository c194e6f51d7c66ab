"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A request with a seed owns a `torch.Generator` seeded once, so its tokens do not depend on what else
is in the batch. Sampling uses the exponential race (argmax of p / Exp(1) noise), which draws from
`p` exactly and lets each row use its own generator.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


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


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

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
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[int]:
        """logits [n, vocab] (fp32) -> one token id per row."""
        assert logits.shape[0] == len(params) == len(request_ids)
        logits = logits.float()
        out = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            sub = logits[idx] / torch.tensor(
                [params[i].temperature for i in rows], device=logits.device
            ).unsqueeze(1)
            if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in rows):
                top_k = torch.tensor([params[i].top_k for i in rows], device=logits.device)
                top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device, dtype=sub.dtype)
                sub = apply_top_k_top_p(sub, top_k, top_p)
            probs = sub.softmax(dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(rows):
                gen = self.generator_for(request_ids[i], params[i], logits.device)
                noise[j].exponential_(generator=gen)
            out[idx] = (probs / noise).argmax(dim=-1)
        return out.tolist()
