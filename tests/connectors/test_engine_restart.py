"""Warm restart: a NEW engine process hits every full chunk a previous one stored, even after the
store server itself restarted (its disk tier rebuilds the index), with identical output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.connectors.conftest import ServerProcess
from tests.connectors.engine_util import ENGINE, _tokenizer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TEXT = (
    "A field guide to the birds of the estuary. The curlew probes the mud with its long curved bill; "
    "the redshank calls before anything else on the marsh has noticed you; the little egret stalks the "
    "channels in bright white plumage. "
)


def generate_in_new_process(store_url: str, prompt: str) -> tuple[list[int], int, int]:
    cmd = [
        sys.executable,
        "-m",
        "kvstore.engine",
        "generate",
        "--prompt",
        prompt,
        "--json",
        "--max-tokens",
        "6",
    ]
    cmd += ["--ignore-eos", "--kv-backend", "kvstore", "--kv-store-url", store_url, "--num-threads", "1"]
    cmd += ["--max-model-len", str(ENGINE["max_model_len"]), "--kv-cache-memory", ENGINE["kv_cache_memory"]]
    env = {**os.environ, "PYTHONHASHSEED": str(len(store_url))}  # keys must not care
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    m = re.search(r"kvstore: (\d+) of (\d+) prompt tokens came from the store", done.stderr)
    assert m, done.stderr[-3000:]
    return out["token_ids"], int(m.group(1)), int(m.group(2))


def test_new_engine_process_and_restarted_server_hit_every_chunk(tmp_path) -> None:
    prompt = TEXT * 12
    n = len(_tokenizer().encode(prompt))
    assert 512 < n < 768, n
    args = ("--tiers", "cpu,disk", "--disk-path", str(tmp_path / "disk"))
    server = ServerProcess(*args).start()
    try:
        first, hits, queries = generate_in_new_process(server.url, prompt)
        assert (hits, queries) == (0, n)
        port = server.port
        server.kill()  # SIGKILL: acknowledged chunks are on disk; the cpu tier is gone
        server = ServerProcess(*args).start(port=port)
        second, hits, queries = generate_in_new_process(server.url, prompt)
        assert second == first
        assert (hits, queries) == (512, n), "every full chunk below the last prompt token"
    finally:
        server.stop()
