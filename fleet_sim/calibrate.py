"""Measure the `smollm2-cpu` cost profile on this machine by running the real kvstore-engine.

    flock /tmp/kvstore-heavy.lock .venv/bin/python -m kvstore.fleet_sim.calibrate [--out FILE]

What it times (SmolLM2-135M-Instruct, kvstore-engine's defaults otherwise):
- prefill: one request of n random tokens and max_tokens=1, for n in PREFILL_LENGTHS, and one of n new
  tokens after a head of `cached` that the prefix cache holds, for (cached, n) in CONTINUED; least
  squares of t = c + a n + b (n cached + n(n-1)/2) give the cost per token (a), per token and token of
  context before it (b, attention) and of a step (c: 6-8 ms here, which long prompts alone leave to a);
- decode: B requests of a short prompt and 1+DECODE_STEPS tokens (ignore_eos), the engine stepped by
  hand: the median of the steps where all B decode is the step time at batch B; the same with long
  prompts (DECODE_CONTEXTS) gives the cost per token of context a decoding request attends to (its
  KV), and the table is kept at zero context (a decode step with no context is the table's value);
- the store: a real kvstore-server (cpu tier) on 127.0.0.1; a prompt run twice (prefix caching off) is
  loaded back the second time; load seconds over loaded tokens from the engine's own metrics (the
  counters `kvstore-engine router` calibrates from); the first run computes and saves it: its time
  over a prompt's of the same length without a store, timed in turn with it, per token, is the
  engine's cost of saving (save_s_per_token).

The median of REPEATS interleaved runs is kept: the typical step (the fastest of them ran 2-3% below
the steps of a real run's engines). Writes the profile JSON (date, machine, every measured point).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstore.engine.router.calibrate import parse_totals

PROFILES = Path(__file__).parent / "profiles"
PREFILL_LENGTHS = (128, 256, 512, 1024, 2048)
# (cached prefix, new tokens): a prompt whose head the prefix cache holds (a conversation's next turn),
# which pins the cost of a step (c) that long prompts alone leave to the per-token term
CONTINUED = ((256, 1), (704, 1), (704, 16), (256, 64))
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_STEPS = 24
# (batch, prompt tokens) decoded after long prompts: the attention's cost per token of context (each
# batch one of DECODE_BATCHES, whose short-prompt step it is compared with)
DECODE_CONTEXTS = ((1, 1024), (4, 512))
REPEATS = 3  # interleaved rounds over every size; the median of each is kept
PROMPT = 64  # tokens of each decode request's prompt


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from kvstore.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    t = time.perf_counter()
    llm.generate(prompts, sp)
    return time.perf_counter() - t


def fit_prefill(
    points: dict[int, float], continued: dict[tuple[int, int], float] | None = None
) -> tuple[float, float, float]:
    """(a, b, c) of t = c + a n + b (n x cached + n (n - 1) / 2) for n new tokens after `cached` ones
    (0 for `points`, prompts from scratch; `continued`: (cached, n) -> t) by least squares, none
    negative (a term that would be is dropped and the rest refitted)."""
    import numpy as np

    rows = [(0, n, t) for n, t in sorted(points.items())] + [
        (c, n, t) for (c, n), t in sorted((continued or {}).items())
    ]
    cached = np.array([r[0] for r in rows], dtype=float)
    n = np.array([r[1] for r in rows], dtype=float)
    t = np.array([r[2] for r in rows])
    cols = {"a": n, "b": n * cached + n * (n - 1) / 2, "c": np.ones_like(n)}
    names = list(cols)
    while True:
        coef, *_ = np.linalg.lstsq(np.stack([cols[k] for k in names], 1), t, rcond=None)
        got = dict(zip(names, coef, strict=True))
        bad = [k for k in names if got[k] < 0 and k != "a"]
        if not bad:
            return float(got.get("a", 0.0)), float(got.get("b", 0.0)), float(got.get("c", 0.0))
        names.remove(bad[0])


def fit_decode(
    table: dict[int, float], long: dict[tuple[int, int], float], short_context: float
) -> tuple[dict[int, float], float]:
    """(the step time per batch at zero context, seconds per token of context) from `table` (batch ->
    step time, each request with `short_context` tokens before its new one) and `long` ((batch,
    context) -> step time): the context term is the mean over `long` of its extra time per extra token
    of context (0 if that is negative), and is taken off `table`; a bigger batch never steps faster
    (a dip between two batches, noise, takes the smaller batch's time)."""
    assert all(batch in table for batch, _ in long), "long-context batches are measured short too"
    per_token = [
        (t - table[batch]) / (batch * (context - short_context)) for (batch, context), t in long.items()
    ]
    d = max(statistics.fmean(per_token), 0.0) if per_token else 0.0
    out, floor = {}, 0.0
    for b, t in sorted(table.items()):
        floor = max(floor, t - d * b * short_context, 0.0)
        out[b] = floor
    return out, d


def _decode_step(llm, prompts: list[list[int]]) -> float:
    """Median seconds of the engine steps in which every one of `prompts` decodes."""
    prompt_tokens = sum(len(p) for p in prompts)
    from kvstore.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=1 + DECODE_STEPS, ignore_eos=True, temperature=0.0)
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, sp)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    prefill_steps = -(-prompt_tokens // engine.args.max_num_batched_tokens)
    decoding = times[prefill_steps + 1 : -1] or times[-1:]
    return statistics.median(decoding)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvstore-server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("kvstore-server did not start listening")


def measure_compute(rng: random.Random) -> dict:
    from kvstore.engine.llm import LLM

    llm = LLM("smollm2")  # prefix caching on: random prompts share nothing, continued ones their head
    try:
        _timed(llm, [_tokens(128, rng)], 2)  # warm-up
        prefill: dict[int, list[float]] = {}
        continued: dict[tuple[int, int], list[float]] = {}
        decode: dict[int, list[float]] = {}
        decode_long: dict[tuple[int, int], list[float]] = {}
        for _ in range(REPEATS):  # interleaved: a burst of other work on the box spoils one round, not a size
            for n in PREFILL_LENGTHS:
                prefill.setdefault(n, []).append(_timed(llm, [_tokens(n, rng)], 1))
            for cached, n in CONTINUED:
                head = _tokens(cached, rng)
                _timed(llm, [head], 1)  # now in the prefix cache
                continued.setdefault((cached, n), []).append(_timed(llm, [head + _tokens(n, rng)], 1))
            for b in DECODE_BATCHES:
                decode.setdefault(b, []).append(_decode_step(llm, [_tokens(PROMPT, rng) for _ in range(b)]))
            for b, n in DECODE_CONTEXTS:
                decode_long.setdefault((b, n), []).append(
                    _decode_step(llm, [_tokens(n, rng) for _ in range(b)])
                )
        from kvstore.engine.config import ModelConfig

        args = llm.engine.args
        cfg = ModelConfig.from_pretrained(llm.engine.model_dir)
        median = statistics.median
        return {
            "prefill": {n: median(ts) for n, ts in prefill.items()},
            "continued": {k: median(ts) for k, ts in continued.items()},
            "decode": {b: median(ts) for b, ts in decode.items()},
            "decode_long": {k: median(ts) for k, ts in decode_long.items()},
            "max_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
            "dtype": str(llm.engine.kv_cache_dtype),
            "kv": {
                "dtype_bytes": llm.engine.kv_cache_dtype.itemsize,
                "layers": cfg.num_layers,
                "kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
            },
        }
    finally:
        llm.engine.shutdown()


def measure_store(rng: random.Random, prompt_tokens: int = 2048) -> dict:
    from kvstore.engine.llm import LLM

    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "kvstore-server"), "--host", "127.0.0.1", "--port", str(port),
             "--tiers", "cpu", "--cpu-capacity", "1GiB", "--state-dir", tmp, "--log-level", "WARNING"],
        )  # fmt: skip
        try:
            _wait_up(port, server)
            llm = LLM("smollm2", enable_prefix_caching=False, kv_store_url=f"http://127.0.0.1:{port}")
            plain = LLM("smollm2", enable_prefix_caching=False)  # the same prompts without a store, in turn
            try:
                _timed(llm, [_tokens(128, rng)], 1)  # warm-up
                _timed(plain, [_tokens(128, rng)], 1)
                per_token, saved, extra = [], [], []
                for _ in range(REPEATS):
                    t_plain = _timed(plain, [_tokens(prompt_tokens, rng)], 1)
                    prompt = _tokens(prompt_tokens, rng)
                    saved.append(_timed(llm, [prompt], 1))  # computes and saves
                    extra.append(saved[-1] - t_plain)
                    before = parse_totals(llm.engine.render_metrics().decode())
                    _timed(llm, [prompt], 1)  # loads
                    after = parse_totals(llm.engine.render_metrics().decode())
                    loaded = after["loaded"] - before["loaded"]
                    if loaded <= 0:
                        raise RuntimeError("the second run loaded nothing from the kvstore-server")
                    per_token.append((after["load_s"] - before["load_s"]) / loaded)
                return {"load_s_per_token": statistics.median(per_token), "prompt_tokens": prompt_tokens,
                        "prefill_saved_s": statistics.median(saved), "save_extra_s": statistics.median(extra)}  # fmt: skip
            finally:
                llm.engine.shutdown()
                plain.engine.shutdown()
        finally:
            server.terminate()
            server.wait(timeout=30)


def measured_of(compute: dict, store: dict) -> dict:
    """Everything measured, as the profile keeps it (and --refit rebuilds a profile from)."""
    return {
        "prefill_s": {str(n): t for n, t in sorted(compute["prefill"].items())},
        "prefill_continued_s": {f"{c}+{n}": t for (c, n), t in sorted(compute["continued"].items())},
        "decode_step_s": {str(b): t for b, t in sorted(compute["decode"].items())},
        "decode_long_step_s": {f"{b}x{n}": t for (b, n), t in sorted(compute["decode_long"].items())},
        "load_s_per_token": store["load_s_per_token"],
        "store_prompt_tokens": store["prompt_tokens"],
        "prefill_saved_s": store["prefill_saved_s"],
        "save_extra_s": store["save_extra_s"],
        "kv": compute["kv"],
        "kv_dtype": compute["dtype"],
        "max_batched_tokens": compute["max_batched_tokens"],
        "max_num_seqs": compute["max_num_seqs"],
    }


def build_profile(measured: dict, machine: str, date: str, host: str) -> dict:
    prefill = {int(n): t for n, t in measured["prefill_s"].items()}
    decode = {int(b): t for b, t in measured["decode_step_s"].items()}
    lengths = sorted(prefill)
    continued = {
        (int(c), int(n)): t
        for k, t in measured.get("prefill_continued_s", {}).items()
        for c, n in [k.split("+")]
    }
    per_token, per_ctx, per_step = fit_prefill(prefill, continued)
    long = {
        (int(b), int(n)): t
        for k, t in measured.get("decode_long_step_s", {}).items()
        for b, n in [k.split("x")]
    }
    # a request decoding step i of 1..DECODE_STEPS has PROMPT + i - 1 tokens before its new one
    short = PROMPT + (DECODE_STEPS - 1) / 2
    table, decode_ctx = fit_decode(
        decode, {(b, n + (DECODE_STEPS - 1) / 2): t for (b, n), t in long.items()}, short
    )
    kv = measured["kv"]
    kv_bytes_per_token = 2 * kv["layers"] * kv["kv_heads"] * kv["head_dim"] * kv["dtype_bytes"]  # K and V
    load_s_per_token = measured["load_s_per_token"]
    load_gbps = kv_bytes_per_token / load_s_per_token / 1e9
    n_store = measured["store_prompt_tokens"]
    extra = measured.get(
        "save_extra_s", measured.get("prefill_saved_s", 0.0) - prefill.get(n_store, math.inf)
    )
    save_s = max(extra, 0.0) / n_store
    here = f"measured by fleet_sim/calibrate.py on {host}"
    return {
        "name": "smollm2-cpu",
        "model": "SmolLM2-135M-Instruct (kvstore-engine, bfloat16, 1 torch thread)",
        "machine": machine,
        "date": date,
        "kv_bytes_per_token": {
            "value": kv_bytes_per_token,
            "source": f"K and V x {kv} ({measured['kv_dtype']}, the model's config.json)",
        },
        "prefill_s_per_token": {
            "value": per_token,
            "source": f"{here}: t = c + a n + b (n cached + n(n-1)/2) for n new tokens after `cached` "
            f"ones, fitted over prompts of {lengths} tokens (measured.prefill_s) and cached+new "
            f"{sorted(continued)} (measured.prefill_continued_s): a",
        },
        "prefill_s_per_token_ctx": {"value": per_ctx, "source": f"{here}: b of the same fit (attention)"},
        "prefill_step_s": {
            "value": per_step,
            "source": f"{here}: c of the same fit (a step's own cost, seen in a turn with 1 new token)",
        },
        "save_s_per_token": {
            "value": save_s,
            "source": f"{here}: a {n_store}-token prompt computed and saved to a real kvstore-server "
            "minus the same length without a store, run in turn with it (the median of the rounds' differences, "
            "measured.save_extra_s), per token",
        },
        "decode_step_s": {
            "value": {str(b): t for b, t in table.items()},
            "source": f"{here}: the median step with every request decoding (measured.decode_step_s; "
            f"{PROMPT}-token prompts, {DECODE_STEPS} steps, the median of {REPEATS} rounds) less the context "
            "term below: the step at zero context",
        },
        "decode_s_per_ctx_token": {
            "value": decode_ctx,
            "source": f"{here}: decode steps after long prompts (measured.decode_long_step_s, batch x prompt "
            f"tokens) over the {PROMPT}-token ones at the same batch, per extra token of context",
        },
        "max_batched_tokens": {"value": measured["max_batched_tokens"], "source": "kvstore-engine's default"},
        "max_num_seqs": {"value": measured["max_num_seqs"], "source": "kvstore-engine's default"},
        "engine_kv_gib": {"value": 0.5, "source": "kvstore-engine's default kv_cache_memory (512MiB)"},
        "engines_per_server": {"value": 64, "source": "one box: every engine talks to one kvstore-server"},
        "server_gib": {"value": 4, "source": "kvstore-server's default --cpu-capacity (4GiB)"},
        "tiers": {
            "server": {
                "load_gbps": {
                    "value": load_gbps,
                    "source": f"{here}: a real kvstore-server (cpu tier) on 127.0.0.1, a "
                    f"{measured['store_prompt_tokens']}-token prompt loaded back: kv bytes/token / "
                    f"{load_s_per_token:.3g} s/token (the engine's connector metrics)",
                },
                "aggregate_gbps": {"value": load_gbps, "source": "one server process: the same"},
            },
            "valkey": {
                "load_gbps": {"value": load_gbps, "source": "not measured here: taken equal to the server's"},
                "aggregate_gbps": {
                    "value": load_gbps,
                    "source": "not measured here: taken equal to the server's",
                },
            },
        },
        "network": {
            "hop_latency_s": {"value": 0.0, "source": "loopback: inside the measured load time"},
            "nic_gbps": {"value": 0, "source": "0 = unlimited: loopback is inside the measured load time"},
        },
        "measured": measured,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROFILES / "smollm2-cpu.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--refit", action="store_true", help="rebuild --out from its own measurements")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.refit:
        old = json.loads(args.out.read_text())
        host = old["prefill_s_per_token"]["source"].split(" on ", 1)[1].split(":", 1)[0]
        profile = build_profile(old["measured"], old["machine"], old["date"], host)
    else:
        rng = random.Random(args.seed)
        measured = measured_of(measure_compute(rng), measure_store(rng))
        machine = (
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}"
        )
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        profile = build_profile(measured, machine, date, platform.node() or "this machine")
    args.out.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    print(json.dumps({k: profile[k]["value"] for k in ("prefill_s_per_token", "prefill_s_per_token_ctx",
                                                        "prefill_step_s", "save_s_per_token", "decode_step_s")}, indent=2))  # fmt: skip


if __name__ == "__main__":
    from kvstore.provenance import recorded

    recorded(main, "fleet_sim_calibrate")
