"""Every reference to a document resolves: a `*.md` path named in any file of the repository exists
(relative to the root or to the naming file), a section named as `docs/design.md §N` or `#anchor` is a
heading of that document, and the design document's own `§N` and `(#anchor)` links land. A design
document cited but never committed is how 26 references once pointed at nothing (issue 35 item 1)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".ini", ".html", ".js", ".c", ".sh"}
TEXT_NAMES = {"Makefile", "Dockerfile"}
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", "kvstore.egg-info", "artifacts", "build", "dist"}

# a path ending in .md, not inside a URL or a longer path (no word, '/', '.' or '-' just before it)
MD_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)(?:#([\w-]+))?(?![\w])")
# "design.md §4", "design.md, §4", "design.md §0, §13", "design.md §4 and §10"
DESIGN_SECTIONS = re.compile(r"design\.md((?:\s*,?\s*(?:and\s+)?§\s*\d+)+)")
SECTION = re.compile(r"§\s*(\d+)")
LOCAL_ANCHOR = re.compile(r"\]\(#([\w-]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
NUMBERED = re.compile(r"^##\s+(\d+)\.\s", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    return {slug(h) for h in HEADING.findall(strip_code(markdown))}


def sections(markdown: str) -> set[int]:
    return {int(n) for n in NUMBERED.findall(markdown)}


def strip_code(markdown: str) -> str:
    """Markdown without its fenced code blocks (a `#` line there is no heading)."""
    return re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)


def dangling(text: str, where: Path, root: Path = ROOT) -> list[str]:
    """The references in `text` (the contents of file `where`) that do not resolve. mkdocs.yml names
    its pages relative to its docs_dir, `docs/`."""
    bad: list[str] = []
    for m in MD_PATH.finditer(text):
        path, anchor = m.group(1), m.group(2)
        bases = (root, where.parent, root / "docs") if where.name == "mkdocs.yml" else (root, where.parent)
        target = next((base / path for base in bases if (base / path).is_file()), None)
        if target is None:
            bad.append(f"{path} (no such file)")
        elif anchor and anchor not in anchors(target.read_text()):
            bad.append(f"{path}#{anchor} (no such heading)")
    design = root / "docs" / "design.md"
    numbers = sections(design.read_text()) if design.is_file() else set()
    for m in DESIGN_SECTIONS.finditer(text):
        for n in SECTION.findall(m.group(1)):
            if int(n) not in numbers:
                bad.append(f"docs/design.md §{n} (no such section)")
    if where.suffix == ".md":
        own = anchors(text)
        bad += [f"#{a} (no such heading in {where.name})" for a in LOCAL_ANCHOR.findall(text) if a not in own]
    if where == design:
        bad += [f"§{n} (no such section)" for n in SECTION.findall(text) if int(n) not in numbers]
    return bad


def repo_files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            p = Path(dirpath) / name
            if p.suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
                out.append(p)
    return out


def test_every_doc_reference_resolves() -> None:
    bad = []
    for path in repo_files():
        if path == Path(__file__).resolve():  # its examples of dangling references are on purpose
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        bad += [f"{path.relative_to(ROOT)}: {b}" for b in dangling(text, path)]
    assert bad == []


def test_the_design_document_is_in_the_repository_and_linked_from_the_readme() -> None:
    assert DESIGN.is_file()
    assert "design.md" in (ROOT / "mkdocs.yml").read_text(), "a page of the docs site"
    assert sections(DESIGN.read_text()) == set(range(14))  # the numbered sections docstrings cite
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def test_a_dangling_reference_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# d\n\n## 1. Keys\n\n## 2. Blobs\n\nsee §2, not §7\n")
    where = tmp_path / "x.py"
    ok = '"""The blob (docs/design.md §2); keys (docs/design.md, §1); docs/design.md#1-keys."""'
    assert dangling(ok, where, tmp_path) == []
    assert dangling("(see DESIGN" + ".md, Spec 4)", where, tmp_path) == ["DESIGN.md (no such file)"]
    assert dangling("docs/design.md §1, §9", where, tmp_path) == ["docs/design.md §9 (no such section)"]
    assert dangling("docs/design.md#3-codecs", where, tmp_path) == [
        "docs/design.md#3-codecs (no such heading)"
    ]
    assert dangling("https://example.com/docs/NOTES.md and ../x/y.py", where, tmp_path) == []
    (tmp_path / "docs" / "page.md").write_text("# p\n")
    nav = "nav:\n  - P: page.md\n  - Q: gone.md\n"  # mkdocs.yml: pages relative to docs/
    assert dangling(nav, tmp_path / "mkdocs.yml", tmp_path) == ["gone.md (no such file)"]
    design = tmp_path / "docs" / "design.md"
    assert dangling(design.read_text() + "[x](#2-blobs) [y](#nope)\n", design, tmp_path) == [
        "#nope (no such heading in design.md)",
        "§7 (no such section)",
    ]
