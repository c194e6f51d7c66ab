"""One vLLM engine (`vllm.LLM`) in a process of its own, driven over stdin/stdout by the tests.

    python -m tests.connectors.vllm.llm_driver '{"model": DIR, "tensor_parallel_size": 2, ...}'

`LLM()` starts its EngineCore and workers in other processes and must run under `__main__`, so a test
cannot hold one in-process; this holds one for a whole test module (a start costs 20-45 s here). Each
line on stdin is a request, `{"prompt": [token ids], "max_tokens": n, "salt": str|null,
"prompt_logprobs": bool}`; each answer is one line on stdout prefixed with `RESULT ` (vLLM logs on
stdout too): `{"tokens", "logprobs" (of each generated token), "prompt_logprobs" (of each prompt token
vLLM computed; null where its KV came from a cache), "cached" (prompt tokens not computed)}`.
`{"op": "reset"}` empties vLLM's own prefix cache (the store is then the only place to hit);
`{"op": "stats"}` answers the connector's counters vLLM aggregated (`LLM.get_metrics()`).
"""

from __future__ import annotations

import json
import sys
import traceback

READY = "READY"
RESULT = "RESULT "


def _answer(obj: object) -> None:
    sys.stdout.write(RESULT + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _run(llm, req: dict) -> dict:  # noqa: ANN001 (vllm.LLM)
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    op = req.get("op", "generate")
    if op == "reset":
        return {"reset": bool(llm.reset_prefix_cache())}
    if op == "stats":
        return {m.name: getattr(m, "value", None) for m in llm.get_metrics() if hasattr(m, "value")}
    want_prompt = bool(req.get("prompt_logprobs"))
    params = SamplingParams(
        temperature=0.0, max_tokens=int(req.get("max_tokens", 8)), ignore_eos=True, logprobs=0,
        prompt_logprobs=0 if want_prompt else None,
        skip_reading_prefix_cache=False,  # prompt logprobs of the tokens computed after a hit
    )  # fmt: skip
    prompt = TokensPrompt(prompt_token_ids=list(req["prompt"]))
    if req.get("salt"):
        prompt["cache_salt"] = req["salt"]
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    comp = out.outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs or [], strict=False)]
    plp = None
    if want_prompt and out.prompt_logprobs is not None:
        # vLLM gives the logprobs of the positions it computed only: after a cache hit the list is
        # shorter than the prompt, and its entries are the last positions'
        ids = list(out.prompt_token_ids)
        given = list(out.prompt_logprobs)
        given = [None] * (len(ids) - len(given)) + given
        plp = [None if lp is None or t not in lp else lp[t].logprob for t, lp in zip(ids, given, strict=True)]
    return {"tokens": list(comp.token_ids), "logprobs": logprobs, "prompt_logprobs": plp,
            "cached": out.num_cached_tokens}  # fmt: skip


def main() -> None:
    from vllm import LLM  # noqa: PLC0415

    kwargs = json.loads(sys.argv[1])
    llm = LLM(**kwargs)
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            _answer(_run(llm, json.loads(line)))
        except Exception as e:  # the test sees it; the engine stays up for the next request
            _answer({"error": f"{e!r}", "traceback": traceback.format_exc()})
    del llm


if __name__ == "__main__":
    main()
