"""Structured output (constrained decoding) with xgrammar, as in vLLM V1: a request's
`SamplingParams.structured_outputs` (json schema, regex, choice, EBNF grammar, any JSON object) is
compiled once per tokenizer, and every step masks the logits of the constrained rows.

Modules: `params` (what a request asks for; no xgrammar), `tokenizer_info` (the vocabulary as
xgrammar needs it), `compiler` (the compile cache), `compile_worker` (each compile in a process of
its own, killed at its deadline), `satisfiable` (a grammar whose rules can all complete), `request`
(one request's matcher), `manager` (the engine's entry points: compile before queueing, mask each
step).
"""

from kvstore.engine.structured_output.params import StructuredOutputOptions, StructuredOutputsParams

__all__ = ["StructuredOutputOptions", "StructuredOutputsParams"]
