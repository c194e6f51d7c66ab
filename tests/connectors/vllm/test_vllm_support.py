"""What KVStoreConnectorV1 cannot serve is refused while vLLM builds its config, in the user's process,
before any worker starts or weight loads, with one sentence naming the setting to change; and the
support matrix of docs/vllm.md is the connector's own (`connectors/vllm_support.py: MATRIX`)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from kvstore.connectors import vllm_support

from tests.connectors.vllm.tiny_models import config_dir

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-configs")
    dirs = {kind: config_dir(kind, root) for kind in ("llama", "mla", "lfm2", "gemma3")}
    odd = config_dir("gemma3", root / "odd-window")  # a window of 100 tokens: no multiple of vLLM's 128
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "sliding_window": 100}))
    return {**dirs, "gemma3-100": odd}


def engine_config(model: Path, extra: dict | None = None, policy: str = "recompute", **engine):
    """What `LLM(...)` / `vllm serve` build first: the VllmConfig (no process, no weights)."""
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415

    ktc = KVTransferConfig(kv_connector="KVStoreConnectorV1", kv_connector_module_path="kvstore.connectors.vllm",
                           kv_role="kv_both", kv_connector_extra_config=extra or {"url": "http://127.0.0.1:9"},
                           kv_load_failure_policy=policy)  # fmt: skip
    args = EngineArgs(model=str(model), dtype="bfloat16", enforce_eager=True, max_model_len=2048,
                      skip_tokenizer_init=True, kv_transfer_config=ktc, **engine)  # fmt: skip
    return args.create_engine_config()


REFUSED = [  # (model kind, settings, the setting the message must name)
    ("llama", {"policy": "fail"}, '"kv_load_failure_policy": "recompute"'),
    ("llama", {"extra": {"url": "local"}}, "kv_connector_extra_config.url"),
    ("llama", {"kv_cache_dtype": "int8_per_token_head"}, "--kv-cache-dtype"),
    ("mla", {"extra": {"url": "http://127.0.0.1:9", "codec": "int4"}}, 'codec to "raw"'),
    ("gemma3-100", {}, "--block-size"),
]


@pytest.mark.parametrize("kind,settings,names", REFUSED, ids=[r[2][:24] for r in REFUSED])
def test_each_refusal_comes_before_vllm_starts_anything(tiny, kind, settings, names) -> None:
    """The refusal is raised by vLLM's own config constructor (a pydantic ValidationError, a ValueError,
    as vLLM's own config refusals are), in this process, in well under a second of work."""
    t0 = time.monotonic()
    with pytest.raises(ValueError) as err:
        engine_config(tiny[kind], **settings)
    message = str(err.value)
    assert "KVStoreConnectorV1" in message and names in message, message
    assert time.monotonic() - t0 < 30, "no engine was started"


def test_a_served_config_passes_the_check(tiny) -> None:
    for kind in ("llama", "mla", "lfm2", "gemma3"):  # lfm2: it runs, the connector stores nothing for it
        config = engine_config(tiny[kind])
        assert vllm_support.refusal(config) is None, kind


def test_the_support_matrix_in_the_docs_is_the_connectors_own() -> None:
    page = (ROOT / "docs/vllm.md").read_text()
    table = vllm_support.render_matrix()
    assert table in page, "docs/vllm.md's support matrix differs from render_matrix(): paste it in"
    for row in vllm_support.MATRIX:
        for test in row.tests:
            path, _, name = test.partition("::")
            source = (HERE / path).read_text()
            if name:
                assert re.search(rf"def {re.escape(name.split('[')[0])}\(", source), f"{test} does not exist"


def rewrite_docs() -> None:
    """Put render_matrix() into docs/vllm.md in place of its support matrix table."""
    path = ROOT / "docs/vllm.md"
    page = path.read_text()
    start = page.index("| vLLM setting | status |")
    end = page.index("\n\n", start)
    path.write_text(page[:start] + vllm_support.render_matrix() + page[end:])


if __name__ == "__main__":  # python -m tests.connectors.vllm.test_vllm_support
    rewrite_docs()
