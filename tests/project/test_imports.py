"""The import graph of the project: no cycles (lazy imports inside functions count too), and the
rooms' rules of docs/design.md §0 (imports only point right)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# each room's folder and the import package it installs as (pyproject's package-dir)
ROOMS = {"kvstore": "kvstore", "sdk": "kvstore.sdk", "server": "kvstore.server",
         "connectors": "kvstore.connectors", "engine": "kvstore.engine"}  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([ROOMS[parts[0]], *parts[1:]])


def _room(module: str) -> str:
    """The room a module lives in: the folder of its package (kvstore.sdk.x -> sdk, kvstore.x -> kvstore)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kvstore" and parts[1] in ROOMS else parts[0]


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for room in ROOMS for p in (ROOT / room).rglob("*.py")}
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


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_detector_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_right() -> None:
    allowed = {
        "kvstore": {"kvstore"},
        "sdk": {"sdk", "kvstore"},
        "server": {"server", "kvstore"},
        "connectors": {"connectors", "sdk", "kvstore"},
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
                    or dep == "kvstore.connectors"
                    or dep == "kvstore"
                )
            else:
                ok = dep_room in allowed[room]
            if not ok and not (
                mod == "kvstore.connectors.vllm" or mod.startswith("kvstore.connectors.vllm_")
            ):
                bad.append(f"{mod} -> {dep}")
    assert bad == []


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
