"""How the engine's KV connector is configured: vLLM's --kv-transfer-config, the shorthand flags,
KVSTORE_* environment variables under them, --config files, and a token the store rejects."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvstore.connectors.base import KVConnectorRole
from kvstore.connectors.factory import create_connector
from kvstore.engine.cli import build_parser
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.errors import InvalidRequest

from kvstore.errors import ConfigError
from tests.connectors.conftest import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = {"model_name": "m", "model_config_hash": "h", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8}


def cli_args(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(build_parser().parse_args(["serve", *argv]))


def connector_config(args: EngineArgs):
    """What the engine hands the connector factory, as LLMEngine builds it (layout aside)."""
    config = {**args.kv_connector_extra_config, "kv_role": args.kv_role, "layout": LAYOUT}
    connector = create_connector(args.kv_backend, KVConnectorRole.SCHEDULER, config)
    try:
        return connector.config
    finally:
        connector.shutdown()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [k for k in os.environ if k.startswith(("KVSTORE_", "KV_TRANSFER_"))]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_kv_transfer_config_json_like_vllm(clean_env) -> None:
    ktc = {
        "kv_connector": "KVStoreConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"store_url": "local", "codec": "fp8", "chunk_size": 64},
    }  # fmt: skip
    args = cli_args("--kv-transfer-config", json.dumps(ktc))
    assert (args.kv_backend, args.kv_role) == ("kvstore", "kv_consumer") and not args.kv_producer
    c = connector_config(args)
    assert (c.codec, c.chunk_size, c.kv_role, c.saves) == ("fp8", 64, "kv_consumer", False)
    # the flags stay as shorthands, win over the JSON's extra config, and map to vLLM's role names
    args = cli_args("--kv-transfer-config", json.dumps(ktc), "--kv-codec", "int4")
    assert connector_config(args).codec == "int4"
    for short, role in (("both", "kv_both"), ("prefill", "kv_producer"), ("decode", "kv_consumer")):
        assert cli_args("--kv-backend", "kvstore", "--kv-role", short).kv_role == role
    assert cli_args("--kv-role", "prefill").kv_producer  # a KV flag alone turns the kvstore backend on
    assert cli_args().kv_backend == "none"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-transfer-config", "{not json"], "not valid JSON"),
        (["--kv-transfer-config", '{"kv_role": "kv_both"}'], "kv_connector"),
        (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1"}'], "not available"),
        (["--kv-transfer-config", '{"kv_connector": "KVStoreConnector", "kv_ip": "1.2.3.4"}'], "kv_ip"),
        (
            [
                "--kv-transfer-config",
                '{"kv_connector": "KVStoreConnector", "kv_role": "kv_producer"}',
                "--kv-role",
                "decode",
            ],
            "contradicts",
        ),  # fmt: skip
        (["--kv-backend", "none", "--kv-store-url", "http://127.0.0.1:1"], "needs --kv-backend kvstore"),
        (["--kv-cache-memory", "lots"], "not a size"),
    ],
)
def test_bad_kv_settings_are_one_sentence(clean_env, argv: list[str], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        cli_args(*argv)


def test_environment_reaches_the_connector_through_the_cli(clean_env) -> None:
    """The bug: flag defaults (store_url local, codec raw) used to hide every KV_TRANSFER_* variable."""
    clean_env.setenv("KVSTORE_CODEC", "int4")
    clean_env.setenv("KVSTORE_CHUNK_SIZE", "128")
    clean_env.setenv("KVSTORE_LOCAL_CPU_CAPACITY", "64MiB")
    c = connector_config(cli_args("--kv-backend", "kvstore"))
    assert (c.codec, c.chunk_size, c.local_cpu_capacity) == ("int4", 128, 64 * 2**20)
    c = connector_config(cli_args("--kv-backend", "kvstore", "--kv-codec", "fp8"))  # a flag beats the env
    assert (c.codec, c.chunk_size) == ("fp8", 128)
    clean_env.setenv("KVSTORE_CODEC", "zip")
    with pytest.raises(ConfigError, match="codec"):
        connector_config(cli_args("--kv-backend", "kvstore"))


def test_config_file_and_its_environment_variable(clean_env, tmp_path: Path) -> None:
    f = tmp_path / "engine.yaml"
    f.write_text("max_model_len: 512\nkv_backend: kvstore\nkv_transfer_config:\n  kv_connector: KVStoreConnector\n"
                 "  kv_connector_extra_config: {codec: fp8}\n")  # fmt: skip
    args = cli_args("--config", str(f), "--max-model-len", "256")
    assert args.max_model_len == 256 and args.kv_connector_extra_config == {"codec": "fp8"}
    clean_env.setenv("KVSTORE_CONFIG", str(f))
    assert cli_args().max_model_len == 512
    f.write_text("max_model_lenn: 512\n")
    with pytest.raises(InvalidRequest, match="did you mean 'max_model_len'"):
        cli_args()


def run_engine(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    cmd = [sys.executable, "-m", "kvstore.engine", "generate", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
           "--max-tokens", "2", "--num-threads", "1", *argv]  # fmt: skip
    return subprocess.run(
        cmd, cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT), **(env or {})}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_token_file_env_and_a_rejected_token(smollm2_dir: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    server = ServerProcess("--tiers", "cpu", "--auth-token-file", str(token)).start()
    try:
        model = ["--model", str(smollm2_dir), "--prompt", "The capital of France is Paris. " * 25]
        # the store URL from the environment alone: the engine must use it, and stop at startup
        r = run_engine(*model, "--kv-backend", "kvstore", env={"KVSTORE_STORE_URL": server.url})
        assert r.returncode == 2 and "requires a token" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = run_engine(*model, "--kv-store-url", server.url, "--kv-store-token-file", str(wrong))
        assert r.returncode == 2 and "token was rejected" in r.stderr and "--kv-store-token-file" in r.stderr
        ktc = {"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"store_url": server.url, "chunk_size": 128}}  # fmt: skip
        found = []
        for _ in range(2):  # the second engine process loads what the first stored
            r = run_engine(*model, "--kv-transfer-config", json.dumps(ktc),
                           env={"KVSTORE_AUTH_TOKEN_FILE": str(token)})  # fmt: skip
            assert r.returncode == 0, r.stderr[-3000:]
            m = re.search(r"kvstore: (\d+) of (\d+) prompt tokens came from the store", r.stderr)
            assert m, r.stderr[-3000:]
            found.append((int(m.group(1)), int(m.group(2))))
        (h0, n), (h1, n1) = found
        # every full 128-token chunk, and the first run's partial chunk where it lies within the prompt
        assert h0 == 0 and n1 == n and (n - 1) // 128 * 128 <= h1 <= (n - 1) // 16 * 16 and h1 > 0
    finally:
        server.stop()


def test_a_connector_shortens_the_gil_switch_interval(tiny_engine_dir: Path) -> None:
    """With the connector's threads running Python, the engine thread would wait up to 5 ms for the
    GIL after each kernel call (measured on the short-turn chat); the engine bounds that at 1 ms."""
    from kvstore.engine import LLM
    from kvstore.engine.kv_transfer import GIL_SWITCH_S

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        llm = LLM(str(tiny_engine_dir), num_kv_blocks=16, max_model_len=64)
        llm.shutdown()
        assert sys.getswitchinterval() == 0.005  # no connector: left alone
        ktc = {"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"store_url": "local"}}  # fmt: skip
        llm = LLM(str(tiny_engine_dir), num_kv_blocks=16, max_model_len=64, kv_transfer_config=ktc)
        llm.shutdown()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S)
    finally:
        sys.setswitchinterval(before)
