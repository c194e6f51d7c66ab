"""`kvstore-engine bench serve`: load an OpenAI-compatible server (this engine's `serve`, `vllm serve`,
anything with streaming `/v1/completions`) like `vllm bench serve` does.

Requests go out at `--request-rate` per second (Poisson arrivals; `inf` sends them all at once), at most
`--max-concurrency` in flight. Each one streams (`stream_options.include_usage`), is greedy and asks for
exactly its output length (`ignore_eos`, `min_tokens`). Measured per request: TTFT (first streamed
chunk), inter-token latencies (between chunks), TPOT ((e2e - TTFT) / (tokens - 1)) and end-to-end time.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
from kvstore.engine.bench.datasets import BenchRequest, load_requests
from kvstore.engine.bench.stats import percentiles, write_json
from kvstore.engine.errors import InvalidRequest


@dataclass
class ServeOptions:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None  # default: the first model the server lists
    tokenizer: str = "smollm2"  # model directory whose tokenizer makes the prompts
    dataset: str = "random"
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64
    random_range_ratio: float = 0.0
    seed: int = 0
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    request_timeout: float = 600.0
    metric_percentiles: tuple[int, ...] = (50, 90, 99)
    output_json: str | None = None

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise InvalidRequest(f"--base-url must be an http(s) URL, got {self.base_url!r}")
        self.base_url = self.base_url.rstrip("/")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidRequest("--max-concurrency must be >= 1")
        if not self.request_rate > 0:
            raise InvalidRequest("--request-rate must be > 0 (inf: all at once)")


@dataclass
class RequestMetrics:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, req: BenchRequest, timeout: float
) -> RequestMetrics:
    body = {
        "model": model, "prompt": req.prompt if req.prompt is not None else req.prompt_token_ids,
        "max_tokens": req.output_len, "min_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    m = RequestMetrics(prompt_tokens=len(req.prompt_token_ids))
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                m.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return m
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                now = time.perf_counter()
                if chunk.get("choices"):
                    if m.ttft == 0.0:
                        m.ttft = now - start
                    else:
                        m.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    m.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
        m.e2e = time.perf_counter() - start
        m.ok = m.ttft > 0
        if not m.ok:
            m.error = "the stream had no choices"
        elif m.output_tokens == 0:
            m.output_tokens = len(m.itl) + 1  # a server without usage in streams: one token per chunk
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        m.error = f"{type(e).__name__}: {e}"
    return m


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        if resp.status != 200:
            raise InvalidRequest(f"{base_url}/v1/models answered HTTP {resp.status}")
        data = (await resp.json()).get("data") or []
    if not data:
        raise InvalidRequest(f"{base_url} serves no model")
    return data[0]["id"]


async def _run(opts: ServeOptions, requests: list[BenchRequest]) -> tuple[list[RequestMetrics], float, str]:
    rng = np.random.default_rng(opts.seed)
    limit = asyncio.Semaphore(opts.max_concurrency or len(requests))
    async with aiohttp.ClientSession() as session:
        try:
            model = opts.model or await _first_model(session, opts.base_url)
        except aiohttp.ClientError as e:
            raise InvalidRequest(f"cannot reach {opts.base_url}: {e}") from e
        url = opts.base_url + opts.endpoint

        async def limited(req: BenchRequest) -> RequestMetrics:
            async with limit:
                return await _one(session, url, model, req, opts.request_timeout)

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if opts.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / opts.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, model


def run_serve(opts: ServeOptions) -> dict:
    from kvstore.engine.llm_engine import resolve_model_dir
    from kvstore.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model_dir(opts.tokenizer))
    requests = load_requests(
        opts.dataset, vocab_size=tokenizer.vocab_size, encode=tokenizer.encode, num_prompts=opts.num_prompts,
        input_len=opts.input_len, output_len=opts.output_len, range_ratio=opts.random_range_ratio, seed=opts.seed,
    )  # fmt: skip
    results, duration, model = asyncio.run(_run(opts, requests))
    ok = [m for m in results if m.ok]
    failed = [m for m in results if not m.ok]
    out_tokens = sum(m.output_tokens for m in ok)
    in_tokens = sum(m.prompt_tokens for m in ok)
    ps = opts.metric_percentiles
    tpot = [(m.e2e - m.ttft) / (m.output_tokens - 1) for m in ok if m.output_tokens > 1]
    metrics = {
        "ttft": percentiles([m.ttft for m in ok], ps),
        "tpot": percentiles(tpot, ps),
        "itl": percentiles([x for m in ok for x in m.itl], ps),
        "e2el": percentiles([m.e2e for m in ok], ps),
    }
    rate = "inf" if opts.request_rate == float("inf") else f"{opts.request_rate:g}"
    print(f"== bench serve: {opts.base_url}{opts.endpoint}, model {model} ==")
    print(f"  request rate {rate}/s, max concurrency {opts.max_concurrency or 'unlimited'}")
    print(f"Successful requests:                {len(ok)}")
    print(f"Failed requests:                    {len(failed)}")
    print(f"Benchmark duration (s):             {duration:.2f}")
    print(f"Total input tokens:                 {in_tokens}")
    print(f"Total generated tokens:             {out_tokens}")
    print(f"Request throughput (req/s):         {len(ok) / duration:.2f}")
    print(f"Output token throughput (tok/s):    {out_tokens / duration:.2f}")
    print(f"Total token throughput (tok/s):     {(in_tokens + out_tokens) / duration:.2f}")
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}  # fmt: skip
    for key, title in names.items():
        print(f"---{title}---")
        for stat, value in metrics[key].items():
            label = "Mean" if stat == "mean" else f"P{stat[1:]}"
            print(f"{label + ' ' + key.upper() + ' (ms):':<36}{value * 1e3:.2f}")
    for m in failed[:3]:
        print(f"  failed: {m.error}")
    result = {
        "options": {**asdict(opts), "request_rate": rate},
        "model": model,
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **{f"{k}_s": v for k, v in metrics.items()},
        "errors": [m.error for m in failed],
    }
    write_json(opts.output_json, result)
    return result
