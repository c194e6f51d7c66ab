"""The CLI reference (docs/cli.md) is each command's `--help` as it prints it: every ```text block that
starts with `usage:` is compared, whitespace aside, with the command's own `--help` (at 100 columns),
and every command and subcommand the CLIs have is on the page.

A CLI whose help changed rewrites the page with `.venv/bin/python -m tests.project.test_docs_cli`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/cli.md"
BIN = Path(sys.executable).parent
COMMANDS = ("kvstore-server", "kvstore-engine", "kvstore-fleet-sim")
MD = ".md"  # the page's links, spelled so that test_doc_refs does not read them as this file's
INTRO = f"""# CLI reference

Each command's `--help`, as it prints it (`tests/project/test_docs_cli.py` checks that this page
matches). Every setting of `kvstore-server` also has a YAML key and a `KVSTORE_*` variable
([Operations](operations{MD}#configuration)).
"""
ABOUT = {
    ("kvstore-server",): f"The store's HTTP server ([Server and tiers](server{MD})).",
    ("kvstore-engine",): f"The engine, its OpenAI server, the proxy and the router ([Engine](engine{MD}), "
    f"[The fleet](fleet{MD}#the-router)).",
    ("kvstore-fleet-sim",): f"The fleet simulator ([The fleet](fleet{MD}#the-fleet-simulator)).",
}


def help_text(argv: list[str]) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run([str(BIN / argv[0]), *argv[1:], "--help"], capture_output=True, text=True, env=env,
                          timeout=120, check=True)  # fmt: skip
    return done.stdout


def words(text: str) -> str:
    return " ".join(text.split())


def documented() -> dict[tuple[str, ...], str]:
    """Each help block of the page by the command it is the help of (the words of its usage line
    before the first option)."""
    out = {}
    for block in re.findall(r"^```text\n(usage: .*?)^```", PAGE.read_text(), flags=re.M | re.S):
        argv = []
        for word in block.split()[1:]:
            if word.startswith(("[", "-", "{")) or word.islower() and argv and argv[-1] == "dir":
                break
            argv.append(word)
        out[tuple(a for a in argv if a != "dir")] = block
    return out


def subcommands(help_out: str) -> list[str]:
    """The subcommands a help lists as its first positional argument, {a,b,c}."""
    m = re.search(r"^positional arguments:\n\s+\{([\w,-]+)\}", help_out, re.M)
    return m.group(1).split(",") if m else []


def command_tree() -> list[tuple[str, ...]]:
    """Every command and subcommand, each before its own subcommands."""
    out: list[tuple[str, ...]] = []

    def walk(argv: tuple[str, ...]) -> None:
        out.append(argv)
        for sub in subcommands(help_text(list(argv))):
            walk((*argv, sub))

    for command in COMMANDS:
        walk((command,))
    return out


def write_page() -> None:
    parts = [INTRO]
    for argv in command_tree():
        parts.append(f"{'#' * min(len(argv) + 1, 3)} {' '.join(argv)}\n")
        if argv in ABOUT:
            parts.append(ABOUT[argv] + "\n")
        parts.append("```text\n" + help_text(list(argv)).rstrip() + "\n```\n")
    PAGE.write_text("\n".join(parts))


def test_every_command_and_subcommand_is_on_the_page() -> None:
    want = set(command_tree())
    assert want <= set(documented()), sorted(want - set(documented()))


def test_each_help_block_is_the_commands_help() -> None:
    pages = documented()
    assert len(pages) >= 10
    for argv, block in pages.items():
        assert words(block) == words(help_text(list(argv))), f"docs/cli.md: {' '.join(argv)} --help differs"


if __name__ == "__main__":
    write_page()
