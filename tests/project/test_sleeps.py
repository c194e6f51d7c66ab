"""No test sleeps to wait for time-based behaviour a fake clock can drive (issue 48).

A TTL, a deadline, a breaker's backoff, an age, an idle timeout of our own code is stepped with a
`kvstore.clock.ManualClock` (the store, the server's `open_store`, a `StoreHandle` take one); what
another process or thread does is waited on as a condition (tests/waiting.py). Every `sleep(` left
in tests/ is listed here with its count and why it stays, so a new one must say why too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SLEEP = re.compile(r"\bsleep\(")
SUFFIXES = (".py", ".sh")

ALLOWED: dict[str, tuple[int, str]] = {
    "waiting.py": (2, "the poll interval of wait_until / wait_until_async: waiting on a condition"),
    # the subject: real time against real processes
    "fleet/test_fleet_faults.py": (8, "the load's schedule against a real Valkey Cluster: clients pace "
        "their rounds, the faults land at set times, a primary stays SIGSTOPped 5 s, slots migrate one by "
        "one, and a miss is re-read after the server had time to learn the new slot map"),
    "connectors/sglang/drive.py": (5, "drives real sglang against a SIGSTOPped / killed server: past "
        "the server's arena heartbeat (written by another process) and the backoff of the SDK inside "
        "sglang's HiCache backend (built from its extra config: no clock to step), the slow joiner"),
    "kvstore/test_events_publisher.py": (4, "a hostile peer's bytes reach a publisher in another process: "
        "its memory after it had time to read them is the subject (no event says 'done growing')"),
    "router/fake_engine.py": (3, "the fake engine's time to first token and inter-token latency: the "
        "latency the router measures"),
    "router/test_events_hostile.py": (2, "libzmq's own reconnect after a publisher closes / a frame "
        "over the limit: nothing tells the SUB's socket reconnected"),
    "router/test_dynamo_indexer.py": (2, "Dynamo's indexer (another process) reading a stream: ZMQ's "
        "slow joiner, and an absence (no decode failure) after every batch could arrive"),
    "router/events_util.py": (1, "ZMQ's slow joiner: a SUB that just connected misses the first ms"),
    "engine/test_engine_server.py": (2, "the running step holds the engine 0.5 s (the TTFT it measures "
        "is the subject); the engine subprocess's start poll"),
    "engine/test_server_faults.py": (2, "a step slowed by 20 ms so a request is still running when its "
        "client leaves; an absence: no token generated for 0.3 s after the request was cancelled"),
    "server/test_idle_poll.py": (2, "asyncio.sleep(0): one turn of the event loop, no time"),
    "server/test_limits.py": (1, "headers trickled a byte at a time within the real header deadline "
        "of a real socket (slowloris, the subject)"),
    "server/test_dashboard.py": (1, "the engine subprocess's start poll (vLLM-sized start)"),
    "sdk/test_client_crash.py": (1, "a client killed at a random point of a put or get (the subject)"),
    "sdk/test_arena_index.py": (1, "the arena heartbeat is CLOCK_MONOTONIC written into shared memory "
        "by the server and read by the client: past STALE_S in both processes' clock"),
    "connectors/test_connector_failures.py": (1, "past STALE_S of a killed server's arena heartbeat "
        "(shared memory, the system clock of two processes)"),
    "connectors/test_engine_hung_store.py": (1, "a real engine against a SIGSTOPped server: its "
        "connector's breaker is built from the engine's config (no clock plumbed there yet)"),
    "router/test_router_hostile.py": (1, "polls the router's state, recording every in-flight count"),
    "project/test_listening_once.py": (1, "an absence: nothing more logged just after binding"),
    "kvstore/test_tiers_cpu_disk.py": (1, "a SIGKILL at a random point of a writer's work (jitter)"),
    "kvstore/test_fs_tier.py": (1, "a SIGKILL at a random point inside a write (jitter)"),
    "fleet/test_fleet_netns.py": (1, "in a child's script: connecting across namespaces until served"),
    "fleet/conftest.py": (1, "EvictionWatch's thread polling every node's pub/sub (not a wait)"),
    "engine/test_bench.py": (1, "the engine subprocess's start poll"),
    "connectors/vllm/vllm_util.py": (1, "real vLLM: `vllm serve`'s start poll"),
    "connectors/vllm/test_vllm_tp.py": (1, "real vLLM: poll until its saves reach the store"),
    "connectors/vllm/test_vllm_store.py": (1, "real vLLM: poll until its next stats interval"),
    "connectors/vllm/conftest.py": (1, "real vLLM: the connector (in vLLM's process) retries a "
        "restarted server after its backoff"),
}  # fmt: skip


def sleeps(root: Path) -> dict[str, int]:
    """`sleep(` calls per file under `root` (its path relative to root)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.suffix in SUFFIXES and path.is_file() and path.resolve() != Path(__file__).resolve():
            n = len(SLEEP.findall(path.read_text(errors="replace")))
            if n:
                found[path.relative_to(root).as_posix()] = n
    return found


def unjustified(found: dict[str, int], allowed: dict[str, tuple[int, str]]) -> list[str]:
    """The files with a sleep and no entry, or more sleeps than their entry allows (an entry is a
    ceiling: a sleep removed meanwhile fails nothing; lower the count when you see it)."""
    problems = []
    for name, n in sorted(found.items()):
        want = allowed.get(name, (0, ""))[0]
        if n > want:
            problems.append(f"{name}: {n} sleep( calls, {want} allowed")
    return problems


def test_every_sleep_in_tests_is_justified() -> None:
    problems = unjustified(sleeps(TESTS), ALLOWED)
    assert not problems, (
        "a sleep in tests/ without an entry in tests/project/test_sleeps.py ALLOWED (step a ManualClock "
        "or wait on a condition, tests/waiting.py; else list it with why): " + "; ".join(problems)
    )


def test_every_entry_gives_a_reason() -> None:
    assert all(n > 0 and len(why) > 20 for n, why in ALLOWED.values())


@pytest.mark.parametrize(
    ("files", "expect"),
    [
        (
            {"a/test_x.py": "import time\n" + "time.sle" + "ep(0.5)\n"},
            ["a/test_x.py: 1 sleep( calls, 0 allowed"],
        ),
        ({"waiting.py": ("time.sle" + "ep(1)\n") * 3}, ["waiting.py: 3 sleep( calls, 2 allowed"]),
        ({"waiting.py": "time.sle" + "ep(1)\n"}, []),
        ({"run.sh": "sle" + "ep(1)\n"}, ["run.sh: 1 sleep( calls, 0 allowed"]),
        ({"b.py": "await asyncio.sle" + "ep(0)\n"}, ["b.py: 1 sleep( calls, 0 allowed"]),
        ({"c.py": "x = 1\n"}, []),
    ],
)
def test_a_new_sleep_fails_the_check(tmp_path: Path, files: dict[str, str], expect: list[str]) -> None:
    """The scan finds a sleep added anywhere in a tree, and the check names it."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    allowed = {"waiting.py": ALLOWED["waiting.py"]}
    got = unjustified(sleeps(tmp_path), allowed)
    assert got == expect
