"""KVStoreConnectorV1's settings from a real `VllmConfig` (built by vLLM's own EngineArgs, no engine
started): the layout fingerprint equals the bundled engine's for the same model directory, extra config
reaches the connector, and what it cannot serve is refused at startup."""

from __future__ import annotations

import os
import re

import pytest

from kvstore.errors import ConfigError
from kvstore.keys import KVLayout, root_key
from tests.connectors.conftest import ServerProcess

pytest.importorskip("vllm")


def vllm_config(
    model_dir, extra: dict | None = None, role: str = "kv_both", policy: str = "recompute", **engine
):
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415

    ktc = KVTransferConfig(kv_connector="KVStoreConnectorV1", kv_connector_module_path="kvstore.connectors.vllm",
                           kv_role=role, kv_connector_extra_config=extra or {"url": "http://127.0.0.1:9"},
                           kv_load_failure_policy=policy)  # fmt: skip
    args = EngineArgs(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=2048,
                      kv_transfer_config=ktc, **engine)  # fmt: skip
    return args.create_engine_config()


def test_vllm_and_kvstore_engine_compute_one_fingerprint(model_dir) -> None:
    from kvstore.connectors.vllm import KVStoreConnectorV1, transfer_config  # noqa: PLC0415
    from kvstore.engine.config import ModelConfig  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: PLC0415

    extra = {"url": "http://127.0.0.1:9", "codec": "int4", "token": "t0ken", "timeout_s": 3}
    cfg = vllm_config(model_dir, extra, role="kv_producer")
    config = transfer_config(cfg)
    # what llm_engine gives its connector for the same directory and dtype (kvstore.keys.model_layout)
    engine_cfg = ModelConfig.from_pretrained(model_dir)
    engine_layout = KVLayout.for_model(
        engine_cfg.raw, model=engine_cfg.model_name, kv_dtype="bfloat16", chunk_size=256
    )
    assert config.layout == engine_layout and root_key(config.layout) == root_key(engine_layout)
    assert (config.codec, config.auth_token, config.timeout_s, config.kv_role, config.block_size) == (
        "int4", "t0ken", 3, "kv_producer", 128)  # fmt: skip
    assert config.load_async is True  # loads run between steps: the request waits, others run
    connector = KVStoreConnectorV1(cfg, KVConnectorRole.SCHEDULER, None)
    try:
        assert connector.requires_kv_delivery is False  # a store is best-effort
    finally:
        connector.shutdown()


def test_what_the_connector_cannot_serve_is_refused_at_startup(model_dir) -> None:
    from kvstore.connectors.vllm import transfer_config  # noqa: PLC0415

    # refused while vLLM builds its config (test_vllm_support.py has the others), with vLLM's block size
    with pytest.raises(ValueError, match="chunk_size 192 must be a multiple of the engine block_size 128"):
        transfer_config(vllm_config(model_dir, {"url": "http://127.0.0.1:9", "chunk_size": 192}))


def test_vllms_default_load_failure_policy_is_refused_naming_the_flag(model_dir) -> None:
    """vLLM's default 'fail' would fail a request over a cache miss; the connector does not rewrite
    vLLM's config behind its back (it used to set the private field): it refuses, naming the flag."""
    from kvstore.connectors.vllm import KVStoreConnectorV1  # noqa: PLC0415
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: PLC0415

    assert KVTransferConfig().kv_load_failure_policy == "fail"  # the installed vLLM's default
    with pytest.raises(ValueError, match='"kv_load_failure_policy": "recompute"'):
        vllm_config(model_dir, policy="fail")  # refused while vLLM builds its config
    # and by the connector itself, for a config vLLM built without asking (the policy changed after)
    cfg = vllm_config(model_dir)
    cfg.kv_transfer_config.kv_load_failure_policy = "fail"
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match='"kv_load_failure_policy": "recompute"'):
            KVStoreConnectorV1(cfg, role, None)
    assert cfg.kv_transfer_config.kv_load_failure_policy == "fail", "vLLM's config is left as given"


def test_a_rejected_token_names_vllms_setting(model_dir, tmp_path) -> None:
    from kvstore.connectors.vllm import KVStoreConnectorV1  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: PLC0415

    (tmp_path / "token").write_text("t0ken")
    srv = ServerProcess("--tiers", "cpu", "--auth-token-file", str(tmp_path / "token")).start()
    try:
        for extra in ({"url": srv.url}, {"url": srv.url, "token": "wrong"}):
            with pytest.raises(ConfigError) as err:
                KVStoreConnectorV1(vllm_config(model_dir, extra), KVConnectorRole.SCHEDULER, None)
            message = str(err.value)
            assert '"token_file"' in message and "kv_connector_extra_config" in message, message
            assert "--kv-store-token-file" not in message, "kvstore-engine's flag means nothing to vLLM"
            assert "t0ken" not in message and "wrong" not in message
    finally:
        srv.stop()


# what vLLM's EngineCore does: its logging is configured, then it builds the connector
CONNECTOR_IN_VLLM = """
import sys
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from kvstore.connectors.vllm import KVStoreConnectorV1
from tests.connectors.vllm.vllm_util import transfer_config
from vllm.config import KVTransferConfig
ktc = KVTransferConfig(**transfer_config(sys.argv[2], "kv_both", timeout_s=1))
cfg = EngineArgs(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=2048,
                 kv_transfer_config=ktc).create_engine_config()
KVStoreConnectorV1(cfg, KVConnectorRole.SCHEDULER, None).shutdown()
"""


def test_the_connectors_lines_are_in_vllms_log_with_its_format(model_dir) -> None:
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from tests.connectors.vllm.vllm_util import ROOT  # noqa: PLC0415
    from tests.valkey import free_port  # noqa: PLC0415

    url = f"http://127.0.0.1:{free_port()}"  # nobody there: the connector warns and goes on
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run([sys.executable, "-c", CONNECTOR_IN_VLLM, str(model_dir), url], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    stamp = r"\d\d-\d\d \d\d:\d\d:\d\d"  # vLLM's "LEVEL MM-DD HH:MM:SS [file:line] message"
    assert re.search(rf"WARNING {stamp} \[store_handle\.py:\d+\] the kvstore-server at {url}", done.stdout), (
        done.stdout
    )
    assert re.search(rf"INFO {stamp} \[vllm\.py:\d+\] KVStoreConnectorV1 \(SCHEDULER, kv_both\)", done.stdout)
    assert "does not answer yet" not in done.stderr, "not a bare line from Python's last-resort handler"
