"""`kvstore-engine` (as `python -m kvstore.engine`) in a subprocess: generate, bench, model, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvstore.engine", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_the_subcommands() -> None:
    r = cli("--help")
    assert r.returncode == 0
    for word in ("generate", "serve", "bench", "model"):
        assert word in r.stdout
    r = cli("bench", "throughput", "--help")
    assert r.returncode == 0 and "--compare-hf" in r.stdout and "--kv-backend" in r.stdout


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["serve", "--help"]])
def test_version_and_help_do_not_import_torch(args: list[str]) -> None:
    """torch costs ~2 s to import: --version and --help answer without it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvstore.engine", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")
    }
    assert "kvstore.engine.cli" in imported  # -X importtime did report
    assert "torch" not in imported
    if args == ["--version"]:
        assert r.stdout.startswith("kvstore-engine ")


def test_serve_help_describes_host_and_port() -> None:
    r = cli("serve", "--help")
    assert r.returncode == 0
    flat = " ".join(r.stdout.split())
    assert "--host HOST address to listen on (default 127.0.0.1" in flat
    assert "--port PORT TCP port to listen on (default 8000)" in flat


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "--model", "/nonexistent/model", "--prompt", "hi"], "does not exist"),
        (
            ["generate", "--kv-backend", "kvstore", "--kv-store-url", "redis://x", "--prompt", "hi"],
            "store_url",
        ),
        (["serve", "--kv-backend", "kvstore", "--kv-store-url", "ftp://x"], "store_url"),
        (["bench", "latency", "--kv-backend", "kvstore", "--kv-store-url", "nowhere"], "store_url"),
        (["generate", "--model", "/nonexistent", "--block-size", "12", "--prompt", "hi"], "power of two"),
    ],
)
def test_bad_arguments_exit_2_with_a_message_not_a_traceback(args: list[str], message: str) -> None:
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_generate_prints_the_completion(smollm2_dir: Path) -> None:
    r = cli("generate", "--model", str(smollm2_dir), "--prompt", "The capital of France is", "--max-tokens", "8",
            "--json", "--max-model-len", "128", "--kv-cache-memory", "16MiB")  # fmt: skip
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in record["text"] and len(record["token_ids"]) <= 8
    bad = cli("generate", "--model", str(smollm2_dir), "--prompt", "hi", "--temperature", "-1")
    assert bad.returncode == 2 and "temperature" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_model_smollm2_reuses_a_complete_directory(smollm2_dir: Path) -> None:
    r = cli("model", "smollm2", str(smollm2_dir.parent))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == smollm2_dir


@pytest.mark.slow
def test_bench_latency_and_throughput_print_their_figures(smollm2_dir: Path) -> None:
    common = [
        "--model",
        str(smollm2_dir),
        "--max-model-len",
        "64",
        "--kv-cache-memory",
        "16MiB",
        "--input-len",
        "16",
    ]
    lat = cli("bench", "latency", *common, "--output-len", "3", "--batch-size", "2", "--num-iters", "1",
              "--num-iters-warmup", "0")  # fmt: skip
    assert lat.returncode == 0, lat.stderr
    assert "time to first token" in lat.stdout and "inter-token latency" in lat.stdout
    thr = cli("bench", "throughput", *common, "--num-prompts", "2", "--output-len", "3", "--compare-hf")
    assert thr.returncode == 0, thr.stderr
    assert "output tokens/s" in thr.stdout and "transformers" in thr.stdout and "speedup" in thr.stdout
