"""The README runs as written: every `bash` and `python` block of the tour, the configuration section
and the keys section, in document order, in one working directory, as a user would paste them; the
vLLM section's the same way in a test of its own (it starts vLLM twice: its server, then `LLM()`).

What the test changes, and only that: the ports in the blocks become free ones (other servers may run
on this machine), HOME is a fresh directory (so `~/.cache/kvstore` is empty, except that the
converted SmolLM2 is linked in rather than converted again), and every server a block starts in the
background is stopped at the end.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_SECTIONS = ("A 5-minute tour", "Configuration", "Chunk keys")
VLLM_SECTION = ("Use with vLLM",)
PORTS = (8100, 8101, 8102, 8103, 8104, 8000, 8001, 6379)
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def runnable_blocks(text: str, sections: tuple[str, ...] = RUN_SECTIONS) -> list[tuple[str, str]]:
    """(language, code) of every ```bash / ```python block in `sections`, in order."""
    blocks = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        if section.startswith(sections):
            blocks += re.findall(r"^```(bash|python)\n(.*?)^```", section, flags=re.M | re.S)
    return blocks


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_the_readme_has_runnable_blocks() -> None:
    blocks = runnable_blocks((ROOT / "README.md").read_text())
    langs = [lang for lang, _ in blocks]
    assert langs.count("bash") >= 5 and langs.count("python") >= 3
    assert not any("await " in code and "async def" not in code for lang, code in blocks if lang == "python")


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
    log = work / "readme.log"
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
            assert done.returncode == 0, f"README block {i} ({lang}) failed:\n{code}\n{text[-3000:]}"
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


def quoted(readme: str, pattern: str) -> tuple[int, ...]:
    """The numbers of the one place the README quotes output matching `pattern`."""
    (found,) = re.findall(pattern, readme)
    return tuple(int(x) for x in found)


@pytest.mark.slow
def test_readme_runs_as_written(smollm2_dir: Path, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    everything = run_blocks(runnable_blocks(readme), smollm2_dir, tmp_path)
    assert everything.count('{"status": "ok"}') >= 4, "every server the tour starts answered /healthz"
    assert "(1, 'not_stored')" in everything, "the SDK block's lookup"
    assert "reachable=True, authorized=True" in everything and "tiers=('cpu', 'disk')" in everything
    assert "Paris" in everything, "the engine answered the tour's question"
    assert '"choices"' in everything, "the OpenAI server answered"
    line = r"kvstore: (\d+) of (\d+) prompt tokens came from the store"
    runs = re.findall(line, everything)
    (first, n), (second, n2) = [(int(h), int(q)) for h, q in runs]
    # every full 256-token chunk and the first run's partial chunk, up to the block before the last token
    assert first == 0 and n2 == n and second == (n - 1) // 16 * 16 > 512, runs
    assert quoted(readme, rf"`{line}`") == (second, n), "the README quotes what the second run printed"
    assert "cpu_capacity: not a size: 'lots'" in everything


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install kvstore-llm[vllm])")
def test_readme_vllm_section_runs_as_written(smollm2_dir: Path, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = runnable_blocks(readme, VLLM_SECTION)
    assert [lang for lang, _ in blocks] == ["bash", "python"]
    everything = run_blocks(blocks, smollm2_dir, tmp_path)
    assert re.search(r"INFO .* KVStoreConnectorV1 \(SCHEDULER, kv_both\)", everything), "in vLLM's log"
    assert '"choices"' in everything, "vLLM's server answered"
    line = r"vLLM: (\d+) of (\d+) prompt tokens were not computed"
    ((cached, n),) = [(int(c), int(q)) for c, q in re.findall(line, everything)]
    # the server's full chunks and its 128-aligned partial, up to the block before the last token
    assert cached == (n - 1) // 128 * 128 > 256, (cached, n)
    assert quoted(readme, rf"`{line}`") == (cached, n), "the README quotes what LLM() printed"
