"""vLLM's `LLM()` in its own process for `bench throughput --compare-vllm` (run as a script, never
imported: vLLM spawns processes and must start under `__main__`, and `connectors/vllm.py` stays the only
module of the package that imports vllm).

Protocol, one JSON object per line: the parent writes `{"requests": [[token_ids, output_len], ...]}` to
stdin; the worker answers on stdout with a line `KVSTORE-BENCH {"wall": s, "cpu": s, "output_tokens": n}`
(cpu covers this process and its children: vLLM's EngineCore does the work). Everything else vLLM
prints is ignored by the parent. An empty line or EOF ends the worker.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MARKER = "KVSTORE-BENCH "


def _cpu_seconds() -> float:
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _reply(payload: dict) -> None:
    sys.stdout.write(MARKER + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    args = parser.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        enforce_eager=not args.compile,
        enable_prefix_caching=False,  # every round sends the same prompts
        seed=0,
    )
    warm = TokensPrompt(prompt_token_ids=list(range(100, 108)))
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    _reply({"ready": True, "vllm_version": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            break
        requests = json.loads(line)["requests"]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        cpu0, wall0 = _cpu_seconds(), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall0, _cpu_seconds() - cpu0
        _reply({"wall": wall, "cpu": cpu, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})
    del llm  # shuts the EngineCore process down


if __name__ == "__main__":
    main()
