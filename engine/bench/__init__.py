"""`kvstore-engine bench latency|throughput|serve` (vLLM's `vllm bench` names and figures).

- `latency`: TTFT / inter-token / end-to-end percentiles of a batch run together (latency.py);
- `throughput`: tokens/s and CPU-seconds, optionally next to transformers and vLLM in the same run,
  interleaved round by round (throughput.py, systems.py);
- `serve`: load a running OpenAI-compatible server (serve.py);
- `latency|throughput --structured-output json`: JSON-schema vs free decoding (structured.py).
The prompts come from datasets.py (random or JSONL), the statistics from stats.py.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.errors import InvalidRequest


def _dataset_args(p: argparse.ArgumentParser, num_prompts: int, input_len: int, output_len: int) -> None:
    p.add_argument("--dataset", default="random",
                   help="'random' (seeded token ids) or a JSONL file of {\"prompt\" | \"prompt_token_ids\", "
                        "\"output_len\"?} lines")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=input_len, help="random dataset: prompt length")
    p.add_argument(
        "--output-len", type=int, default=output_len, help="tokens per request (unless the JSONL says)"
    )
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random dataset: lengths uniform in len * [1 - r, 1 + r] (vLLM's random dataset)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


def _structured_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--structured-output", choices=["none", "json"], default="none",
                   help="json: JSON-schema vs free decoding of the same prompts, rounds interleaved "
                        "(structured.py): per-token overhead, grammar compile time")  # fmt: skip


def add_bench_parsers(bench: argparse._SubParsersAction) -> None:
    lat = bench.add_parser("latency", help="TTFT and inter-token latency percentiles")
    EngineArgs.add_cli_args(lat)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=32)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    lat.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    _structured_arg(lat)

    thr = bench.add_parser("throughput", help="tokens/s and CPU-seconds, optionally vs transformers and vLLM")
    EngineArgs.add_cli_args(thr)
    _dataset_args(thr, num_prompts=16, input_len=128, output_len=64)
    thr.add_argument("--num-rounds", type=int, default=3, help="rounds per system, interleaved")
    thr.add_argument("--compare-hf", action="store_true", help="also run transformers generate, same prompts")
    thr.add_argument(
        "--compare-vllm", action="store_true", help="also run vLLM (when installed), same prompts"
    )
    thr.add_argument(
        "--vllm-compile", action="store_true", help="let vLLM compile its model (default: eager)"
    )
    thr.add_argument("--measure-decode", action="store_true",
                     help="also time 1-token runs: decode tokens/s and ms per decode step")  # fmt: skip
    thr.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    _structured_arg(thr)

    srv = bench.add_parser("serve", help="load a running OpenAI-compatible server (like vllm bench serve)")
    srv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    srv.add_argument("--endpoint", default="/v1/completions")
    srv.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    srv.add_argument(
        "--tokenizer", default="smollm2", help="model directory whose tokenizer makes the prompts"
    )
    _dataset_args(srv, num_prompts=32, input_len=128, output_len=64)
    srv.add_argument("--max-concurrency", type=int, default=None)
    srv.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)"
    )
    srv.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    srv.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles")
    srv.add_argument("--output-json", default=None, help="also write the figures to this JSON file")


def _options(cls, ns: argparse.Namespace, **override):
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)} | override)


def main(ns: argparse.Namespace) -> dict:
    if ns.bench == "serve":
        from kvstore.engine.bench.serve import ServeOptions, run_serve

        try:
            ps = tuple(int(p) for p in ns.metric_percentiles.split(",") if p.strip())
        except ValueError:
            raise InvalidRequest(
                f"--metric-percentiles: not a list of ints: {ns.metric_percentiles!r}"
            ) from None
        return run_serve(_options(ServeOptions, ns, metric_percentiles=ps))
    args = EngineArgs.from_cli_args(ns)
    structured = getattr(ns, "structured_output", "none") == "json"
    if structured:
        from kvstore.engine.bench import structured as so_bench
    if ns.bench == "latency":
        from kvstore.engine.bench.latency import LatencyOptions, run_latency

        if structured:
            return so_bench.run_latency(args, _options(LatencyOptions, ns))
        return run_latency(args, _options(LatencyOptions, ns))
    from kvstore.engine.bench.throughput import ThroughputOptions, run_throughput

    if structured:
        return so_bench.run_throughput(args, _options(ThroughputOptions, ns))
    return run_throughput(args, _options(ThroughputOptions, ns))
