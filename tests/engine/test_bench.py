"""`kvstore-engine bench`: datasets, throughput with transformers and vLLM side by side, and the serve
client against a real engine server. Mechanics run on a tiny checkpoint (with SmolLM2's tokenizer);
the figures themselves are the benchmark's business, never asserted here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kvstore.engine.bench.datasets import jsonl_requests, random_requests
from kvstore.engine.bench.serve import ServeOptions, run_serve
from kvstore.engine.errors import InvalidRequest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvstore.engine", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_random_requests_are_seeded_and_vary_within_the_range() -> None:
    a = random_requests(1000, 64, 40, 20, range_ratio=0.5, seed=3)
    assert a == random_requests(1000, 64, 40, 20, range_ratio=0.5, seed=3)
    assert a != random_requests(1000, 64, 40, 20, range_ratio=0.5, seed=4)
    in_lens = {len(r.prompt_token_ids) for r in a}
    out_lens = {r.output_len for r in a}
    assert min(in_lens) >= 20 and max(in_lens) <= 60 and len(in_lens) > 10
    assert min(out_lens) >= 10 and max(out_lens) <= 30 and len(out_lens) > 5
    assert all(100 <= t < 1000 for r in a for t in r.prompt_token_ids)
    fixed = random_requests(1000, 4, 40, 20)
    assert {len(r.prompt_token_ids) for r in fixed} == {40} and {r.output_len for r in fixed} == {20}
    with pytest.raises(InvalidRequest, match="range-ratio"):
        random_requests(1000, 4, 40, 20, range_ratio=1.0)


def test_jsonl_dataset_reads_text_ids_and_output_lengths(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "hello world"},
        {"prompt_token_ids": [5, 6, 7], "output_len": 3},
        {"prompt": "x", "max_tokens": 9},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = jsonl_requests(path, lambda s: [ord(c) for c in s], output_len=11)
    assert [r.prompt_token_ids for r in reqs] == [[ord(c) for c in "hello world"], [5, 6, 7], [ord("x")]]
    assert [r.output_len for r in reqs] == [11, 3, 9]
    assert reqs[0].prompt == "hello world" and reqs[1].prompt is None
    assert len(jsonl_requests(path, lambda s: [1], output_len=4, num_prompts=2)) == 2
    for bad, message in [
        ('{"prompt": "a"}\nnot json\n', ":2: not JSON"),
        ('{"prompt_token_ids": []}\n', "prompt_token_ids"),
        ('{"prompt": "a", "output_len": 0}\n', "output_len"),
        ("[1, 2]\n", "JSON object"),
        ("\n", "no requests"),
    ]:
        path.write_text(bad)
        with pytest.raises(InvalidRequest, match=message):
            jsonl_requests(path, lambda s: [1], output_len=4)
    with pytest.raises(InvalidRequest, match="cannot read"):
        jsonl_requests(tmp_path / "missing.jsonl", lambda s: [1], output_len=4)


@pytest.mark.slow
def test_throughput_against_transformers_and_vllm_writes_json(tiny_engine_dir: Path, tmp_path: Path) -> None:
    vllm = pytest.importorskip("vllm", reason="--compare-vllm needs vllm installed")
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt_token_ids": list(range(100, 100 + n)), "output_len": 4})
                                 for n in (5, 17, 9)))  # fmt: skip
    out = tmp_path / "thr.json"
    r = _cli("bench", "throughput", "--model", str(tiny_engine_dir), "--max-model-len", "64", "--kv-cache-memory",
             "4MiB", "--dataset", str(dataset), "--num-rounds", "2", "--compare-hf", "--compare-vllm",
             "--measure-decode", "--output-json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"vllm {vllm.__version__}" in r.stdout and "speedup vs transformers" in r.stdout
    result = json.loads(out.read_text())
    assert result["num_requests"] == 3 and set(result["systems"]) == {
        "kvstore-engine",
        "transformers",
        "vllm",
    }
    for name, figures in result["systems"].items():
        assert len(figures["output_tokens_per_s"]["rounds"]) == 2, name
        assert figures["cpu_seconds"]["median"] > 0 and figures["decode_tokens_per_s"]["median"] > 0
        assert figures["output_tokens_per_s"]["lo"] <= figures["output_tokens_per_s"]["median"]
    assert set(result["ratios"]) == {"transformers", "vllm"}
    assert set(result["ratios"]["vllm"]) == {"throughput", "cpu_efficiency", "decode"}


@pytest.mark.slow
def test_throughput_rejects_requests_longer_than_the_model(tiny_engine_dir: Path) -> None:
    r = _cli("bench", "throughput", "--model", str(tiny_engine_dir), "--max-model-len", "32", "--kv-cache-memory",
             "4MiB", "--input-len", "30", "--output-len", "8")  # fmt: skip
    assert r.returncode == 2 and "max_model_len" in r.stderr and "Traceback" not in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_server(tiny_engine_dir: Path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.engine", "serve", "--model", str(tiny_engine_dir), "--port", str(port),
         "--max-model-len", "64", "--kv-cache-memory", "4MiB"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the engine server did not start: {proc.stderr.read()[-2000:]}"
                    ) from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_serve_reports_latency_percentiles_and_counts_failures(
    tiny_server: str, tiny_engine_dir: Path, tmp_path: Path
) -> None:
    dataset = tmp_path / "d.jsonl"  # the tiny model's 320 ids, not the tokenizer's 49152
    lens = [(5, 3), (12, 6), (8, 2), (20, 5), (3, 4), (9, 7)]
    dataset.write_text("\n".join(json.dumps({"prompt_token_ids": list(range(100, 100 + n)), "output_len": k})
                                 for n, k in lens))  # fmt: skip
    out = tmp_path / "serve.json"
    opts = ServeOptions(base_url=tiny_server, tokenizer=str(tiny_engine_dir), dataset=str(dataset), num_prompts=6,
                        max_concurrency=2, request_rate=50.0, output_json=str(out))  # fmt: skip
    result = run_serve(opts)
    assert result["completed"] == 6 and result["failed"] == 0
    # ignore_eos + min_tokens: exactly what was asked; usage came back in the stream
    assert result["total_output_tokens"] == sum(k for _, k in lens)
    assert result["total_input_tokens"] == sum(n for n, _ in lens)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert 0 < result[key]["p50"] <= result[key]["p99"], key
    assert result["e2el_s"]["p50"] >= result["ttft_s"]["p50"]
    assert json.loads(out.read_text())["completed"] == 6
    # Requests the server refuses (ids outside its vocabulary) are failures with the server's message.
    bad = run_serve(ServeOptions(base_url=tiny_server, tokenizer=str(tiny_engine_dir), num_prompts=2, input_len=8,
                                 output_len=4, request_rate=float("inf")))  # fmt: skip
    assert bad["completed"] == 0 and bad["failed"] == 2 and "HTTP 400" in bad["errors"][0]


def test_serve_needs_a_reachable_http_url(smollm2_dir: Path) -> None:
    with pytest.raises(InvalidRequest, match="http"):
        ServeOptions(base_url="127.0.0.1:8000")
    with pytest.raises(InvalidRequest, match="cannot reach"):
        run_serve(
            ServeOptions(
                base_url=f"http://127.0.0.1:{_free_port()}", tokenizer=str(smollm2_dir), num_prompts=1
            )
        )
