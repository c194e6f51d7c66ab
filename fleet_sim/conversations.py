"""The slice of the Mooncake conversation trace that benchmarks/bench_router.py sends to a real fleet
and validate.py replays in the simulator: which conversations, in which rounds, how long each prompt
and answer is once scaled (bench_router.py's docstring tells why). Both import it from here; they
exchange their results as JSON (bench_router.py --json, validate.read_runs).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from kvstore.fleet_sim.trace import TRACES

TRACE = TRACES / "mooncake_conversation_trace.jsonl"
NO_STORE = "round_robin/no-store"  # the baseline: a fleet without kvstore


def conversations(path: Path, window: int) -> list[list[dict]]:
    """The conversations among the first `window` requests of `path`: requests sharing their first two
    blocks with another one, in trace order of their first turns."""
    rows = [json.loads(line) for _, line in zip(range(window), path.open(), strict=False)]
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in rows:
        if len(r["hash_ids"]) >= 2:
            groups[tuple(r["hash_ids"][:2])].append(r)
    convs = [g for g in groups.values() if len(g) >= 2]
    return sorted(convs, key=lambda g: g[0]["timestamp"])


def rounds(
    convs: list[list[dict]], per_round: int, n_rounds: int, how: str = "spread"
) -> list[list[list[dict]]]:
    """Each round's conversations: spread evenly over `convs` (round r of R: the r-th of every R), or
    (`how="first"`) the first ones."""
    if len(convs) < per_round * n_rounds:
        raise SystemExit(f"the window has {len(convs)} conversations, {per_round * n_rounds} needed")
    if how == "first":
        return [convs[r * per_round : (r + 1) * per_round] for r in range(n_rounds)]
    stride = len(convs) / (per_round * n_rounds)
    return [[convs[int((i * n_rounds + r) * stride)] for i in range(per_round)] for r in range(n_rounds)]


def prompt_tokens(row: dict, block_tokens: int, max_blocks: int) -> int:
    """A request's prompt, scaled: `block_tokens` per 512-token block, cut at `max_blocks` blocks and to
    the scaled input_length."""
    blocks = len(row["hash_ids"][:max_blocks])
    return min(blocks * block_tokens, max(1, round(row["input_length"] * block_tokens / 512)))


def output_tokens(row: dict) -> int:
    """A request's answer, scaled: output_length / 64 tokens, 1 to 8."""
    return max(1, min(8, round(row["output_length"] / 64)))


def pct(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (the nearest rank below)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]
