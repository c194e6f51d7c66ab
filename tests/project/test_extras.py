"""Packaging: a fresh virtualenv with only `kvstore-llm[server]` runs kvstore-server and the SDK, and
holds none of the engine's dependencies (triton, numba, tokenizers, transformers...). jinja2 is the one
exception, and only because torch itself requires it (the blob format's dtypes are torch's). pip
resolves from the machine's configured indexes and wheel cache (torch's CPU wheel); nothing of the
test's own venv is shared."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ONLY = {"triton", "numba", "tokenizers", "jinja2", "transformers", "safetensors", "gguf", "tqdm"}
SDK_SCRIPT = """
import torch
from kvstore.sdk import Store
from kvstore.errors import CodecError
from kvstore.keys import KVLayout, chunk_keys
keys = chunk_keys(range(64), KVLayout("m", "h", num_layers=2, num_kv_heads=1, head_dim=8, chunk_size=32))
kv = torch.randn(2, 2, 32, 1, 8, dtype=torch.float16)
with Store.connect(URL) as store:
    store.put(keys[0], kv)
    assert torch.equal(store.get(keys[0]), kv)
    assert store.lookup(keys) == (1, "not_stored")
with Store.local(tiers=["cpu"]) as local:
    try:
        local.codec = "int4"
        local.put(keys[1], torch.randn(2, 2, 32, 1, 64, dtype=torch.float16))  # a shape int4 takes
    except CodecError as e:
        assert "kvstore-llm[codecs]" in str(e), e
    else:
        raise AssertionError("int4 on CPU without numba must say which extra it needs")
print("sdk ok")
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a fresh venv, torch included, and a wheel built: minutes on a busy 2-core box
def test_server_extra_alone_runs_the_server_and_the_sdk(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, bin_dir = env_dir / "bin" / "python", env_dir / "bin"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("KVSTORE_")
    }
    env["KVSTORE_DATA_DIR"] = str(tmp_path / "data")
    src = tmp_path / "src"  # what the Dockerfile copies: the build writes into its source tree, not ours
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE", "constraints.txt"):
        shutil.copy(ROOT / name, src / name)
    for room in ("kvstore", "sdk", "server", "connectors", "engine", "fleet_sim"):
        shutil.copytree(ROOT / room, src / room, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [py, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("kvstore_llm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        top = {n.split("/")[0] for n in zf.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"kvstore"}, f"the wheel puts {sorted(top)} at the top of site-packages"
    install = subprocess.run(
        [py, "-m", "pip", "install", "-q", "-c", str(src / "constraints.txt"), f"kvstore-llm[server] @ {wheel.as_uri()}"],
        capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run(
        [py, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, env=env
    )
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert {"kvstore-llm", "torch", "aiohttp", "uvloop"} <= names
    shown = subprocess.run([py, "-m", "pip", "show", "torch"], capture_output=True, text=True, env=env).stdout
    from_torch = {r.strip().lower() for r in shown.split("Requires:")[1].splitlines()[0].split(",")}
    pulled = names & ENGINE_ONLY - from_torch
    assert pulled == set(), f"the server extra pulled {pulled}"
    assert "triton" not in names and "numba" not in names and "tokenizers" not in names

    version = subprocess.run(
        [bin_dir / "kvstore-server", "--version"], capture_output=True, text=True, env=env
    )
    assert version.returncode == 0 and re.fullmatch(r"kvstore-server \S+\n", version.stdout), version
    server = subprocess.Popen(
        [bin_dir / "kvstore-server", "--port", "0", "--tiers", "cpu"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        seen = []  # its log lines (stderr is merged) may come first
        for _ in range(20):
            seen.append(server.stdout.readline())
            if m := re.search(r"listening on (http://\S+)", seen[-1]):
                break
        assert m, "".join(seen)
        sdk = subprocess.run(
            [py, "-c", SDK_SCRIPT.replace("URL", repr(m.group(1)))], capture_output=True, text=True,
            env=env, cwd=tmp_path, timeout=120,
        )  # fmt: skip
        assert sdk.returncode == 0 and "sdk ok" in sdk.stdout, sdk.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(30)
    engine = subprocess.run(
        [bin_dir / "kvstore-engine", "generate", "--prompt", "hi"], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert engine.returncode == 2 and "pip install 'kvstore-llm[engine]'" in engine.stderr, engine.stderr[
        -2000:
    ]
    assert "Traceback" not in engine.stderr
    assert sys.prefix != str(env_dir)  # the test's own interpreter was never used for any of it
