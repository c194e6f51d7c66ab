"""bench_ttft.py's chat workloads are the ones its docstring and issue 13 describe (the short-turn
goal is measured on them): a 300-token system prompt; 20 conversations; short turns of 20-80-token
messages and 16-64-token answers over 6 turns; documents of 500 tokens with 4 turns of 40 + 16."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench_ttft():
    spec = importlib.util.spec_from_file_location("bench_ttft", ROOT / "benchmarks" / "bench_ttft.py")
    module = sys.modules["bench_ttft"] = importlib.util.module_from_spec(spec)  # its dataclasses need it
    spec.loader.exec_module(module)
    return module


def test_chat_workloads_have_the_documented_shape(smollm2_dir: Path) -> None:
    bench = _bench_ttft()
    args = argparse.Namespace(conversations=20, turns=6)
    w = bench.workloads(args)
    short, doc = w["short"], w["document"]
    assert len(short.system) == 300 and doc.system == short.system
    assert len(short.messages) == 20 and all(len(m) == 6 for m in short.messages)
    assert all(20 <= len(m) <= 80 for conv in short.messages for m in conv)
    assert all(16 <= p.max_tokens <= 64 and p.ignore_eos for conv in short.answers for p in conv)
    assert short.openings == [[]] * 20
    assert [len(o) for o in doc.openings] == [500] * 20
    assert all(len(m) == 40 for conv in doc.messages for m in conv) and all(len(m) == 4 for m in doc.messages)
    assert all(p.max_tokens == 16 for conv in doc.answers for p in conv)
    # the conversations differ (every turn is new to the engine and the store)
    assert len({tuple(conv[0]) for conv in short.messages}) == 20
    assert short.longest == 300 + max(
        sum(len(m) + p.max_tokens for m, p in zip(ms, ps, strict=True))
        for ms, ps in zip(short.messages, short.answers, strict=True)
    )
