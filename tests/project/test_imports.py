"""The import graph of the project: no cycles (lazy imports inside functions count too), the rooms'
rules of docs/design.md §0 (imports only point right) and the core's layers (imports only point down)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# each room, the folder it lives in and the import package it installs as (setup.py's PACKAGE_DIR)
ROOMS = {
    "kvstore": ("kvstore", "kvstore"),
    "sdk": ("sdk", "kvstore.sdk"),
    "server": ("server", "kvstore.server"),
    "connectors": ("connectors", "kvstore.connectors"),
    "engine": ("engine", "kvstore.engine"),
    "fleet_sim": ("fleet_sim", "kvstore.fleet_sim"),  # the fleet simulator
}
# top-level packages of the repository that no room may import: they are not installed with it
OUTSIDE = ("benchmarks", "tests", "examples")
# docs/design.md §0: the core's layers, lowest first. A core module imports only modules of its own
# layer and of the layers below it; a new core module must be placed in one.
CORE_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("kvstore", "kvstore.errors", "kvstore.keys", "kvstore.settings", "kvstore.config",
              "kvstore.c_build", "kvstore.lru", "kvstore.breaker", "kvstore.miss_log", "kvstore.event_types",
              "kvstore.clock", "kvstore.tier_registry", "kvstore.tier_settings", "kvstore.provenance")),
    ("protocol", ("kvstore.protocol",)),
    ("front_door", ("kvstore.front_door",)),  # the HTTP front door the server and the engine share
    ("codecs", ("kvstore.codecs",)),
    ("blob", ("kvstore.blob",)),
    ("tiers", ("kvstore.tiers",)),
    ("store", ("kvstore.store", "kvstore.transcode", "kvstore.acks", "kvstore.metrics", "kvstore.tier_calls",
               "kvstore.write_back", "kvstore.write_fence")),
    ("events", ("kvstore.events", "kvstore.store_events", "kvstore.token_hints")),
)  # fmt: skip


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    for folder, package in ROOMS.values():
        if rel.parts[: len(Path(folder).parts)] == Path(folder).parts:
            parts = list(rel.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise AssertionError(f"{rel} is in no room")


def _room(module: str) -> str:
    """The room a module lives in: the folder of its package (kvstore.sdk.x -> sdk, kvstore.x -> kvstore);
    for an import of something outside the rooms, its top-level package (benchmarks, tests, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kvstore" and parts[1] in ROOMS else parts[0]


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for folder, _ in ROOMS.values() for p in (ROOT / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                if t.split(".")[0] in OUTSIDE:  # out of the installed package: its module, as named
                    if "." in t or isinstance(node, ast.Import):
                        graph[name].add(".".join(t.split(".")[:2]))
                    continue
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is fine
                    graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


# Cycles known and owned elsewhere: none (the simulator's engine is given a Host of its fleet, issue 48
# item 4); a lazy import inside a function, or one under TYPE_CHECKING, counts like any import.
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles() -> None:
    graph = _graph()
    assert _cycles({m: {d for d in deps if d in graph} for m, deps in graph.items()}) == KNOWN_CYCLES


def test_the_cycle_detector_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_right() -> None:
    allowed = {
        "kvstore": {"kvstore"},
        "sdk": {"sdk", "kvstore"},
        "server": {"server", "kvstore"},
        "connectors": {"connectors", "sdk", "kvstore"},
        "fleet_sim": {"fleet_sim", "engine", "kvstore"},  # the simulator runs the router's own decision core
    }
    # the list of docs/design.md §0: the original list plus kvstore.settings: one settings loader and size parser for every command,
    # and kvstore.events: the engine and the server publish KV events in one wire format
    engine_may = {
        "kvstore.connectors.base",
        "kvstore.connectors.factory",
        "kvstore.keys",
        "kvstore.errors",
        "kvstore.settings",
        "kvstore.events",  # the KV events' wire format and publisher, shared with the server
        "kvstore.c_build",  # the one C build helper: the engine's CPU kernels and the rANS kernel
        "kvstore.front_door",  # the HTTP front door (connection limit, listener, body budget), shared with the server
    }
    bad = []
    for mod, deps in _graph().items():
        room = _room(mod)
        for dep in deps:
            dep_room = _room(dep)
            if room == "engine":
                ok = (
                    dep_room == "engine"
                    or dep in engine_may
                    or dep.rpartition(".")[0] in engine_may  # a module of a package on the list
                    or dep == "kvstore.connectors"
                    or dep == "kvstore"
                )
            else:
                ok = dep_room in allowed[room]
            if not ok and not (
                mod == "kvstore.connectors.vllm" or mod.startswith("kvstore.connectors.vllm_")
            ):
                bad.append(f"{mod} -> {dep}")
    assert sorted(bad) == KNOWN_ARROWS_UP


# Imports against the rules that are known and owned elsewhere: none (issue 48 items 3 and 4: the front
# door moved into the core; the simulator records its runs with kvstore.provenance and reads
# benchmarks/bench_router.py's figures from the JSON it writes, importing no benchmark).
KNOWN_ARROWS_UP: list[str] = []


def _layer(module: str) -> int | None:
    """The index of the core layer `module` belongs to (the longest prefix that names it), None if none."""
    best, found = -1, None
    for i, (_, prefixes) in enumerate(CORE_LAYERS):
        for p in prefixes:
            if (module == p or (p != "kvstore" and module.startswith(p + "."))) and len(p) > best:
                best, found = len(p), i
    return found


def _layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """docs/design.md §0: inside the core (the kvstore room) imports point down the layers, never up;
    every core module has a layer."""
    bad = []
    for mod, deps in graph.items():
        if _room(mod) != "kvstore":
            continue
        here = _layer(mod)
        if here is None:
            bad.append(f"{mod} is in no layer of CORE_LAYERS")
            continue
        for dep in deps:
            there = _layer(dep) if _room(dep) == "kvstore" else None
            if there is not None and there > here:
                bad.append(f"{mod} ({CORE_LAYERS[here][0]}) -> {dep} ({CORE_LAYERS[there][0]})")
    return sorted(bad)


def test_the_core_imports_point_down_its_layers() -> None:
    assert _layer_breaches(_graph()) == []


def test_the_layer_rule_sees_a_breach() -> None:
    graph = {
        "kvstore.codecs.transcode": {"kvstore.blob", "kvstore.errors"},
        "kvstore.tiers.cpu": {"kvstore.store", "kvstore.protocol"},
        "kvstore.store": {"kvstore.tiers", "kvstore.events"},
        "kvstore.newcomer": set(),
        "kvstore.sdk.remote": {"kvstore.store"},  # another room: the rooms' rule's business
    }
    assert _layer_breaches(graph) == [
        "kvstore.codecs.transcode (codecs) -> kvstore.blob (blob)",
        "kvstore.newcomer is in no layer of CORE_LAYERS",
        "kvstore.store (store) -> kvstore.events (events)",
        "kvstore.tiers.cpu (tiers) -> kvstore.store (store)",
    ]


def test_every_room_is_seen() -> None:
    """The graph holds every room's modules, the simulator's included, and what they import from
    outside the installed package."""
    graph = _graph()
    assert {_room(m) for m in graph} == set(ROOMS)
    assert "kvstore.fleet_sim.sim" in graph and "kvstore.transcode" in graph


def _protocol_breaches(graph: dict[str, set[str]]) -> list[str]:
    """docs/design.md §0: the SDK and the server meet only in the protocol (kvstore.protocol): the SDK
    imports no server tier (kvstore.tiers), the server no SDK module, and the protocol is readable
    alone (it imports only itself, kvstore.errors and kvstore.keys)."""
    protocol_may = ("kvstore.protocol", "kvstore.errors", "kvstore.keys")
    bad = []
    for mod, deps in graph.items():
        for dep in deps:
            tier = dep == "kvstore.tiers" or dep.startswith("kvstore.tiers.")
            if _room(mod) == "sdk" and tier:
                bad.append(f"{mod} -> {dep}")
            if _room(mod) == "server" and _room(dep) == "sdk":
                bad.append(f"{mod} -> {dep}")
            if mod.startswith("kvstore.protocol") and not any(
                dep == p or dep.startswith(p + ".") for p in protocol_may
            ):
                bad.append(f"{mod} -> {dep}")
    return sorted(bad)


def test_the_sdk_and_the_server_meet_only_in_the_protocol() -> None:
    assert _protocol_breaches(_graph()) == []


def test_the_protocol_rule_sees_a_breach() -> None:
    graph = {
        "kvstore.sdk.shm": {"kvstore.tiers.arena_index", "kvstore.protocol.shm"},
        "kvstore.server.app": {"kvstore.sdk.store", "kvstore.protocol.wire"},
        "kvstore.protocol.wire": {"kvstore.errors", "kvstore.store"},
    }
    assert _protocol_breaches(graph) == [
        "kvstore.protocol.wire -> kvstore.store",
        "kvstore.sdk.shm -> kvstore.tiers.arena_index",
        "kvstore.server.app -> kvstore.sdk.store",
    ]
