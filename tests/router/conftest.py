"""The router tests' tiny engines."""

from __future__ import annotations

import pytest
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.llm_engine import LLMEngine

from tests.engine.conftest import make_tiny_engine_dir
from tests.router.fleet import events_config


@pytest.fixture
def tiny(tmp_path_factory):
    """Engines of this test's own: the engine server's cleanup shuts its engine down (events too)."""
    root = tmp_path_factory.mktemp("router_app")
    model = make_tiny_engine_dir(root / "llama")
    engines = []
    for i in range(3):
        cfg = events_config(root, f"tiny{i}")
        args = EngineArgs(model=str(model), max_model_len=256, kv_cache_memory="4MiB", kv_events_config=cfg)
        engines.append((LLMEngine(args), cfg))
    yield model, engines
    for engine, _ in engines:
        engine.shutdown()
