"""The docs site builds: `mkdocs build --strict` of mkdocs.yml and docs/ passes, and fails on a broken
link or anchor (mkdocs.yml's `validation` turns every kind into a warning, and --strict fails on one);
every page is in the navigation; every benchmark table names its command, machine, commit and date."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytest.importorskip("mkdocs")
pytest.importorskip("material")


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "design").is_dir()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    home = tmp_path / "docs/index.md"
    missing, anchor = "nowhere" + ".md", "server" + ".md#no-such-heading"  # not references of this file
    home.write_text(home.read_text() + f"\n[a page that is not there]({missing})\n")
    done = build(tmp_path, tmp_path / "site")
    assert done.returncode != 0 and missing in done.stderr, done.stderr[-3000:]
    home.write_text(home.read_text().replace(missing, anchor))
    done = build(tmp_path, tmp_path / "site")
    assert done.returncode != 0 and "no-such-heading" in done.stderr, done.stderr[-3000:]


def test_every_page_is_in_the_navigation() -> None:
    nav = set(re.findall(r"^\s+- [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == {p.name for p in DOCS.glob("*.md")}


def test_every_benchmark_table_names_its_command_machine_commit_and_date() -> None:
    """Each section of the benchmarks page that holds a table or a printed run says where it came from
    (the first section, the machines table, excepted)."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    sections = re.split(r"^#{2,3} ", text, flags=re.M)[1:]
    checked = 0
    for section in sections:
        title = section.splitlines()[0]
        if not re.search(r"^\|---|^```text", section, re.M):
            continue
        checked += 1
        for word in ("command", "machine", "commit", "date"):
            assert re.search(rf"\*{word}s?\*", section, re.I), f"{title}: no {word}"
    assert checked >= 12
    assert "this stop" not in text and "previous stop" not in text, "no run-to-run history in the docs"
