"""The README and every page of the docs site run as written: every `bash` and `python` block of a page,
in document order, in one working directory, as a user would paste them; the vLLM page's the same way
in a test of its own (it starts vLLM twice: its server, then `LLM()`). Blocks that cannot run here (a
Docker build, kubectl, a GPU, `make`) are fenced as `console` or `text`, and every fence names its
language, so none is skipped by accident.

What the test changes, and only that: the ports in the blocks become free ones (other servers may run
on this machine), HOME is a fresh directory per page (so `~/.cache/kvstore` is empty, except that the
converted SmolLM2 is linked in rather than converted again), and every server a block starts in the
background is stopped at the end. What the blocks print is checked against what the pages say they
print.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
VLLM_PAGE = ROOT / "docs/vllm.md"
# every port a page's blocks use: HTTP servers, Valkey, the KV-event publishers
PORTS = (8000, 8001, 8002, 8011, 8012, 8100, 8101, 8102, 8103, 8104, 8110, 8200, 8210, 6379)
PORTS += (5557, 5558, 5559, 5560, 5600, 5601)
HAS_VLLM = importlib.util.find_spec("vllm") is not None
RUNNABLE = ("bash", "python")
FENCE = re.compile(r"^```(.*)$", re.M)
STORE_LINE = r"kvstore: (\d+) of (\d+) prompt tokens came from the store"
VLLM_LINE = r"vLLM: (\d+) of (\d+) prompt tokens were not computed"


def pages() -> list[Path]:
    """The README and the docs site's pages."""
    return [README, *sorted(DOCS.glob("*.md"))]


def name(page: Path) -> str:
    """A page as the tests name it: its path from the repository root."""
    return str(page.relative_to(ROOT))


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every ```bash / ```python block of a page, in order."""
    return re.findall(r"^```(bash|python)\n(.*?)^```", text, flags=re.M | re.S)


def opening_fences(text: str) -> list[str]:
    """The language of every fenced block's opening line ('' for none)."""
    langs, inside = [], False
    for m in FENCE.finditer(text):
        if not inside:
            langs.append(m.group(1).strip())
        inside = not inside
    return langs


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def quoted(page: str, pattern: str) -> tuple[int, ...]:
    """The numbers of the one place `page` quotes output matching `pattern`."""
    (found,) = re.findall(pattern, page)
    return tuple(int(x) for x in found)


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert "kvstore-llm" in text and "pip install kvstore\n" not in text
    for page in sorted(
        set(DOCS.glob("*.md")) - {ROOT / "docs/index.md"}
    ):  # the site's home: the README's own
        assert f"docs/{page.name}" in text, f"the README links to {page.name}"


def test_every_fence_names_its_language() -> None:
    """A bare fence would be neither run nor clearly marked as not runnable."""
    for page in pages():
        assert "" not in opening_fences(page.read_text()), f"{name(page)}: a ``` fence without a language"


def test_the_pages_have_runnable_blocks() -> None:
    counts = {name(p): [lang for lang, _ in runnable_blocks(p.read_text())] for p in pages()}
    assert counts["README.md"].count("bash") >= 2 and counts["README.md"].count("python") >= 2
    for page in CHECKS:
        assert "bash" in counts[page], page
    assert counts[name(VLLM_PAGE)] == ["bash", "python"]
    for page in pages():
        for lang, code in runnable_blocks(page.read_text()):
            if lang == "python":
                assert not ("await " in code and "async def" not in code), f"{name(page)}: a top-level await"


def run_blocks(blocks: list[tuple[str, str]], smollm2_dir: Path, tmp_path: Path) -> str:
    """Run `blocks` in order in one fresh working directory, each as a user would paste it; what they
    printed, all together. Fails at the first block that exits non-zero; every server a block left
    in the background is stopped."""
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".cache" / "kvstore" / "models").mkdir(parents=True)
    (home / ".cache" / "kvstore" / "models" / smollm2_dir.name).symlink_to(smollm2_dir)
    work.mkdir()
    mapping = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
    swap = re.compile(r"(?<!\d)(" + "|".join(map(str, PORTS)) + r")(?!\d)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "VLLM_"))}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    holder = subprocess.Popen(["sleep", "3600"], process_group=0)  # the group every block and server joins
    log = work / "blocks.log"
    outputs = []
    try:
        for i, (lang, code) in enumerate(blocks):
            code = swap.sub(lambda m: str(mapping[int(m.group(1))]), code)
            path = work / f"block{i}.{'sh' if lang == 'bash' else 'py'}"
            path.write_text(code)
            cmd = ["bash", "-e", str(path)] if lang == "bash" else [sys.executable, str(path)]
            out = work / f"block{i}.out"
            with open(out, "w") as f:  # a file, not a pipe: a background server keeps its stdout open
                done = subprocess.run(cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT,
                                      timeout=600, process_group=holder.pid)  # fmt: skip
            text = out.read_text()
            outputs.append(text)
            with open(log, "a") as f:
                f.write(f"--- block {i} ({lang}) exit {done.returncode}\n{code}\n--- output\n{text}\n")
            assert done.returncode == 0, f"block {i} ({lang}) failed:\n{code}\n{text[-3000:]}"
    finally:
        os.killpg(holder.pid, signal.SIGTERM)
        try:
            holder.wait(20)
        finally:
            try:
                os.killpg(holder.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return "\n".join(outputs)


def check_store_hit(page: str, everything: str) -> None:
    """Two engine processes generated from the same long prompt: the second loaded every full 256-token
    chunk and the first run's partial chunk, up to the 16-token block before the last token; the page
    quotes what the second run printed."""
    runs = [(int(h), int(q)) for h, q in re.findall(STORE_LINE, everything)]
    (first, n), (second, n2) = runs
    assert first == 0 and n2 == n and second == (n - 1) // 16 * 16 > 512, runs
    assert quoted(page, rf"`{STORE_LINE}`") == (second, n), "the page quotes what the second run printed"


def check_tour(page: str, out: str) -> None:
    assert out.count('{"status": "ok"}') >= 1, "the server answered /healthz"
    assert "(1, 'not_stored')" in out, "the SDK block's lookup"
    assert "Paris" in out, "the engine answered the tour's question"
    check_store_hit(page, out)


def check_getting_started(page: str, out: str) -> None:
    assert "kvstore-server 0." in out and "kvstore-engine 0." in out and "Store" in out
    check_tour(page, out)


def check_server(page: str, out: str) -> None:
    assert out.count('{"status": "ok"}') >= 2, "both servers answered /healthz"
    assert "usage: kvstore-server" in out


def check_sdk(page: str, out: str) -> None:
    assert out.count("(1, 'not_stored')") == 2, "the local and the async remote lookup"
    assert "reachable=True, authorized=True" in out and "tiers=('cpu', 'disk')" in out
    assert re.search(r"'[0-9a-f]{32}'", out), "the chunk keys block printed its keys"


def check_engine(page: str, out: str) -> None:
    assert out.count('{"status": "ok"}') >= 1 and "Paris" in out
    answers = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"choices"' in line]
    assert len(answers) >= 4, "chat, logprobs, json_schema and choice answers"
    contents = [a["choices"][0].get("message", {}).get("content") for a in answers]
    city = next(json.loads(c) for c in contents if c and c.startswith("{"))  # temperature 0: whole JSON
    assert isinstance(city["name"], str) and isinstance(city["population"], int), city
    texts = [a["choices"][0].get("text") for a in answers]
    assert any(t in ("yes", "no") for t in texts), texts
    assert re.search(r"^\d{3}-\d{4}$", out, re.M), "the regex-constrained answer"
    check_store_hit(page, out)


def check_operations(page: str, out: str) -> None:
    assert out.count('{"status": "ok"}') >= 2, "the YAML-configured and the HTTPS server"
    assert "cpu_capacity: not a size: 'lots'" in out
    assert re.search(r"^cpu$", out, re.M), "the SDK reached the HTTPS server trusting its certificate"


def check_fleet(page: str, out: str) -> None:
    assert out.count('{"status": "ok"}') >= 3, "two engines and the router answered /health"
    assert '"id": "SmolLM2-135M-Instruct"' in out, "the router's /v1/models"
    assert re.search(r"^X-KVStore-Engine: http://127\.0\.0\.1:\d+", out, re.M | re.I)
    assert '"choices"' in out and "Paris" in out


CHECKS: dict[str, Callable[[str, str], None]] = {
    "README.md": check_tour,
    "docs/getting-started.md": check_getting_started,
    "docs/server.md": check_server,
    "docs/sdk.md": check_sdk,
    "docs/engine.md": check_engine,
    "docs/operations.md": check_operations,
    "docs/fleet.md": check_fleet,
}


def test_every_page_with_runnable_blocks_is_run_and_checked() -> None:
    """A page whose blocks run has checks of what they print; the vLLM page has a test of its own."""
    runnable = {name(p) for p in pages() if runnable_blocks(p.read_text())}
    assert runnable - {name(VLLM_PAGE)} == set(CHECKS), runnable


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(CHECKS))
def test_page_runs_as_written(page: str, smollm2_dir: Path, tmp_path: Path) -> None:
    text = (ROOT / page).read_text()
    everything = run_blocks(runnable_blocks(text), smollm2_dir, tmp_path)
    CHECKS[page](text, everything)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'kvstore-llm[vllm]')")
def test_vllm_page_runs_as_written(smollm2_dir: Path, tmp_path: Path) -> None:
    page = VLLM_PAGE.read_text()
    blocks = runnable_blocks(page)
    assert [lang for lang, _ in blocks] == ["bash", "python"]
    everything = run_blocks(blocks, smollm2_dir, tmp_path)
    assert re.search(r"INFO .* KVStoreConnectorV1 \(SCHEDULER, kv_both\)", everything), "in vLLM's log"
    assert '"choices"' in everything, "vLLM's server answered"
    ((cached, n),) = [(int(c), int(q)) for c, q in re.findall(VLLM_LINE, everything)]
    # the server's full chunks and its 128-aligned partial, up to the block before the last token
    assert cached == (n - 1) // 128 * 128 > 256, (cached, n)
    assert quoted(page, rf"`{VLLM_LINE}`") == (cached, n), "the page quotes what LLM() printed"
