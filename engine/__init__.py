"""kvstore engine room (docs/design.md §0, §13): a small paged-attention engine with vLLM's names.

from kvstore.engine import LLM, SamplingParams
llm = LLM("smollm2")
out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.engine.llm import LLM
    from kvstore.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import kvstore.engine.convert` (or the CLI's --help) does not pull in torch and the runtime.
    if name == "LLM":
        from kvstore.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvstore.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvstore.engine' has no attribute {name!r}")
