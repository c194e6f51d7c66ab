"""The grammar state of one constrained request: an xgrammar matcher that has accepted every token the
request generated, in order.

The state is a function of the constraint and the generated tokens only, which is why it needs no
care when the KV moves: a preempted request is recomputed from its tokens (the matcher already
accepted them), a prefix-cache or store hit replaces prompt compute, and an engine that takes over a
request (the decode side of a prefill/decode pair) builds it with `generated=` the tokens so far.
"""

from __future__ import annotations

from collections.abc import Sequence

import xgrammar as xgr
from kvstore.engine.errors import InvalidRequest
from kvstore.engine.structured_output.params import StructuredOutputsParams


class StructuredOutputRequest:
    def __init__(
        self, params: StructuredOutputsParams, compiled: xgr.CompiledGrammar, generated: Sequence[int] = ()
    ) -> None:
        self.params = params
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_processed_tokens = 0
        for i, token in enumerate(generated):
            if not self.accept_token(token):
                raise InvalidRequest(
                    f"generated token {i} ({token}) does not follow the {params.kind.value} constraint"
                )

    @property
    def is_terminated(self) -> bool:
        """The grammar ended and a stop token was accepted: the rest of the output is unconstrained
        (only reachable with `ignore_eos` or `min_tokens`, as in vLLM)."""
        return self.matcher.is_terminated()

    def accept_token(self, token: int) -> bool:
        """Advance by one generated token. False when the grammar does not allow it."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.accept_token(token):
            return False
        self.num_processed_tokens += 1
        return True
