"""The tier registry (kvstore/tier_registry.py): what each built-in tier declares, what the registry
refuses, plug-ins from entry points, and settings blocks beside the old flat settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from kvstore import tier_registry
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.settings import load_settings
from kvstore.tier_registry import TierContext, TierSpec, register_tier, spec_of, tier_spec, unregister_tier
from kvstore.tiers import make_tier


def test_what_the_built_in_tiers_declare() -> None:
    table = {
        name: (s.shared, s.durable, s.medium, s.handoff, s.in_memory)
        for name in ("gpu", "cpu", "disk", "redis", "fs")
        for s in [tier_spec(name)]
    }
    assert table == {
        "gpu": (False, False, "GPU", False, True),
        "cpu": (False, False, "CPU", False, True),
        "disk": (False, True, "STORAGE", False, False),
        "redis": (True, True, "REDIS", True, False),
        "fs": (True, True, "FS", True, False),
    }


class Nothing(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = 1


def _spec(name: str, **kw: object) -> TierSpec:
    return TierSpec(name, lambda ctx: None, shared=False, durable=False, medium="X", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "Tape", "ta_pe", "9tape", "x" * 33])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="tier name"):
        register_tier(_spec(name))


def test_clashes_are_refused() -> None:
    with pytest.raises(ConfigError, match="already"):
        register_tier(_spec("cpu"))
    with pytest.raises(ConfigError, match="built in"):
        unregister_tier("cpu")

    class Policy(BaseModel):
        policy: str = "x"

    with pytest.raises(ConfigError, match="store settings"):  # write_policy is the store's
        register_tier(_spec("write", settings=Policy))
    with pytest.raises(ConfigError, match="pydantic"):
        register_tier(_spec("tape", settings=dict))  # type: ignore[arg-type]


def test_a_plug_in_from_an_entry_point(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class EntryPoint:
        name, value = "tape", "tests:tape"

        def load(self) -> TierSpec:
            return _spec("tape", settings=Nothing)

    monkeypatch.setattr(tier_registry, "entry_points", lambda group: [EntryPoint()])
    monkeypatch.setattr(tier_registry, "_plugins_loaded", False)
    try:
        assert tier_spec("tape").medium == "X"
        config = StoreConfig(tiers=["cpu", "tape"], tape_size=7)
        assert config.tier("tape").size == 7 and config.tape_size == 7
    finally:
        unregister_tier("tape")


def test_make_tier_marks_what_it_built(tmp_path: Path) -> None:
    tier = make_tier("cpu", StoreConfig(cpu_capacity="1MiB"))
    assert tier.kind == "cpu" and spec_of(tier) is tier_spec("cpu")  # type: ignore[attr-defined]
    ctx = TierContext("redis", None, state_dir=tmp_path)
    assert ctx.handoff_dir("redis://h:1/0\0p:") == tmp_path / ctx.handoff_dir("redis://h:1/0\0p:").name
    assert ctx.handoff_dir("a") != ctx.handoff_dir("b") and TierContext("x", None).handoff_dir("a") is None


def test_blocks_and_flat_settings_are_one_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    block = StoreConfig(redis={"url": "redis://a:1/0", "prefix": "p:"}, cpu={"capacity": "1MiB"})
    flat = StoreConfig(redis_url="redis://a:1/0", redis_prefix="p:", cpu_capacity="1MiB")
    assert block == flat and block.model_dump() == flat.model_dump() and block.redis_url == "redis://a:1/0"
    assert StoreConfig(**block.model_dump()) == block  # a dump is the same config
    assert StoreConfig(redis={"url": "redis://a:1/0"}, redis_url="redis://b:2/0").redis_url == "redis://b:2/0"
    copy = block.model_copy(update={"cpu_memory": "plain"})
    assert copy.tier("cpu").memory == "plain" and copy.cpu_capacity == 1 << 20 and copy.redis_prefix == "p:"
    f = tmp_path / "kv.yaml"
    f.write_text('redis:\n  url: redis://file:1/0\n  prefix: "f:"\ncpu_capacity: 2MiB\n')
    monkeypatch.setenv("KVSTORE_REDIS_URL", "redis://env:1/0")  # a flat variable beats the file's block
    (config,) = load_settings([StoreConfig], f, {"cpu": {"capacity": "3MiB"}}, use_config_env=False)
    assert (config.redis_url, config.redis_prefix, config.cpu_capacity) == ("redis://env:1/0", "f:", 3 << 20)
    with pytest.raises(ConfigError, match="unknown setting 'redis_urll'"):
        StoreConfig(redis={"urll": "x"})
    with pytest.raises(ConfigError, match="did you mean 'redis_url'"):
        load_settings([StoreConfig], None, {"redis_rul": "x"}, use_config_env=False)
