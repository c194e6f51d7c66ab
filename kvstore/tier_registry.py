"""The tier registry: every kind of tier declares what it is, and the store, its settings, KV events
and hinted handoff read those declarations instead of tier names (docs/design.md §4).

A `TierSpec` says how to build a tier (`build(ctx)`, or a "module:function" that does, loaded when a
tier of that kind is built: how the built-in tiers are registered here, in the core's lowest layer,
without importing them) and what it is:

- `shared`: several kvstore-servers reach the same blobs (redis, fs); else this process's own (cpu,
  gpu) or this host's directory that one process owns (disk). A shared tier is not listed in the KV
  events' first snapshot (other servers' blobs, possibly millions) and is never `trusted`.
- `durable`: its blobs outlive this process (disk, redis, fs).
- `medium`: the KV events medium its stored and removed blocks are published under (§12).
- `handoff`: a delete, or a put replacing a blob, that cannot reach it is remembered and replayed
  (hinted handoff, §10): its builder gets `ctx.handoff_dir`, where the keys survive a restart.
- `settings`: a pydantic model, the tier's settings block. Field `f` of tier `t` is the YAML block
  `t: {f: ...}`, the flat setting `t_f` (`redis_url`), the flag `--t-f` and `KVSTORE_T_F`.
- A tier that neither is shared nor durable lives in this process's memory: calls to it never wait
  (`in_memory`; a server calls such a store inline).

`register_tier(spec)` adds one (a plug-in, or a test's own tier: nothing else needs to change);
packages may also declare specs under the entry-point group `kvstore.tiers` (loaded on first use).
The built-in ones (their settings blocks are kvstore/tier_settings.py, their builders
kvstore/tiers/builtin.py) are registered below, as any other.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvstore import tier_settings as ts
from kvstore.clock import SYSTEM, Clock
from kvstore.errors import ConfigError

ENTRY_POINT_GROUP = "kvstore.tiers"
_NAME_RE = re.compile(r"[a-z][a-z0-9]{0,31}")  # no "_": `t_f` splits one way only


class NoSettings(BaseModel):
    """The settings block of a tier that has none."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class TierContext:
    """What a tier's builder gets: its name, its settings block, the store's clock and, for a tier that
    declares `handoff`, where its invalidations are journaled."""

    name: str
    settings: Any  # an instance of the spec's `settings` model
    clock: Clock = SYSTEM
    state_dir: Path | None = None

    def handoff_dir(self, identity: str) -> Path | None:
        """The journal directory of the backend named by `identity` (a URL and prefix, a directory):
        `<state_dir>/<tier>-handoff-<digest>` (the identity may hold a password); None without a
        state directory (then the invalidations live in memory only)."""
        if self.state_dir is None:
            return None
        digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
        return Path(self.state_dir) / f"{self.name}-handoff-{digest}"


@dataclass(frozen=True)
class TierSpec:
    """One kind of tier: how it is built and what it declares (see the module docstring)."""

    name: str
    build: Callable[[TierContext], Any] | str  # returns a Tier (kvstore.tiers.base); or "module:function"
    shared: bool
    durable: bool
    medium: str
    handoff: bool = False
    settings: type[BaseModel] = NoSettings
    help: str = ""
    builtin: bool = field(default=False, compare=False)

    @property
    def in_memory(self) -> bool:
        return not (self.shared or self.durable)

    def builder(self) -> Callable[[TierContext], Any]:
        """`build`, the "module:function" it names imported."""
        if not isinstance(self.build, str):
            return self.build
        module, _, attr = self.build.partition(":")
        return getattr(importlib.import_module(module), attr)

    def flat_names(self) -> dict[str, str]:
        """Flat setting name -> field of the settings block (`redis_url` -> `url`)."""
        return {f"{self.name}_{f}": f for f in self.settings.model_fields}


_lock = threading.RLock()
_specs: dict[str, TierSpec] = {}
_reserved: set[str] = set()  # the store's own setting names: no tier's flat name may take one
_plugins_loaded = False


def register_tier(spec: TierSpec, replace: bool = False) -> TierSpec:
    """Add `spec` to the registry (ConfigError for a bad name, a name taken, or a setting name that
    another tier or the store already uses). Returns it."""
    if not _NAME_RE.fullmatch(spec.name):
        raise ConfigError(f"a tier name is a-z then a-z0-9, at most 32 characters, got {spec.name!r}")
    if not isinstance(spec.settings, type) or not issubclass(spec.settings, BaseModel):
        raise ConfigError(f"tier {spec.name!r}: settings must be a pydantic model class")
    if not spec.medium or not isinstance(spec.medium, str):
        raise ConfigError(f"tier {spec.name!r}: medium must be a non-empty string")
    with _lock:
        if spec.name in _specs and not replace:
            raise ConfigError(f"a tier named {spec.name!r} is registered already")
        taken = (set(spec.flat_names()) | {spec.name}) & _reserved
        if taken:
            raise ConfigError(f"tier {spec.name!r}: {sorted(taken)} are store settings already")
        _specs[spec.name] = spec
    return spec


def unregister_tier(name: str) -> None:
    """Remove a tier that is not built in (a test's own tier, once it is done)."""
    with _lock:
        spec = _specs.get(name)
        if spec is not None and spec.builtin:
            raise ConfigError(f"tier {name!r} is built in")
        _specs.pop(name, None)


def reserve_settings(names: Iterable[str]) -> None:
    """The store's own setting names (kvstore.config): no tier may declare a flat name among them."""
    with _lock:
        clash = {n for s in _specs.values() for n in [s.name, *s.flat_names()]} & set(names)
        if clash:
            raise ConfigError(f"tier settings {sorted(clash)} clash with store settings")
        _reserved.update(names)


def _load_plugins() -> None:
    global _plugins_loaded
    with _lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                spec = ep.load()
                register_tier(spec() if callable(spec) and not isinstance(spec, TierSpec) else spec)
            except Exception as e:  # one broken plug-in names itself; the others still load
                raise ConfigError(f"tier plug-in {ep.name!r} ({ep.value}) cannot be loaded: {e}") from None


def tier_specs() -> dict[str, TierSpec]:
    """Every registered tier by name, built-in ones first."""
    _load_plugins()
    with _lock:
        return dict(_specs)


def tier_spec(name: str) -> TierSpec:
    """The spec of tier `name`; ConfigError naming the known ones for any other name."""
    spec = tier_specs().get(name)
    if spec is None:
        raise ConfigError(f"unknown tier {name!r}; known: {', '.join(tier_specs())}")
    return spec


def spec_of(tier: Any) -> TierSpec | None:
    """The spec of a tier object: by its `kind` (set by make_tier), else by its name; None for a tier
    the registry does not know (one a test built by hand under a name of its own)."""
    kind = getattr(tier, "kind", None) or getattr(tier, "name", None)
    return tier_specs().get(kind) if isinstance(kind, str) else None


def is_shared(tier: Any) -> bool:
    spec = spec_of(tier)
    return spec is not None and spec.shared


def medium_of(tier_name: str, tier: Any = None) -> str:
    """The KV events medium of a tier (by its object when given, else its name); an unknown tier's is
    its name in capitals."""
    spec = spec_of(tier) if tier is not None else tier_specs().get(tier_name)
    return spec.medium if spec is not None else tier_name.upper()


BUILTIN = (
    TierSpec("gpu", "kvstore.tiers.builtin:gpu", shared=False, durable=False, medium="GPU",
             settings=ts.GpuSettings, builtin=True, help="device memory of this process (needs CUDA)"),
    TierSpec("cpu", "kvstore.tiers.builtin:cpu", shared=False, durable=False, medium="CPU",
             settings=ts.CpuSettings, builtin=True, help="host memory"),
    TierSpec("disk", "kvstore.tiers.builtin:disk", shared=False, durable=True, medium="STORAGE",
             settings=ts.DiskSettings, builtin=True, help="a local directory this process owns"),
    TierSpec("redis", "kvstore.tiers.builtin:redis", shared=True, durable=True, medium="REDIS", handoff=True,
             settings=ts.RedisSettings, builtin=True, help="Redis or Valkey, standalone or Cluster"),
    TierSpec("fs", "kvstore.tiers.builtin:fs", shared=True, durable=True, medium="FS", handoff=True,
             settings=ts.FsSettings, builtin=True, help="a directory several servers share (NFS, Lustre)"),
)  # fmt: skip
for _spec in BUILTIN:
    register_tier(_spec, replace=True)
