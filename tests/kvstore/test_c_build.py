"""kvstore/c_build.py, the one C build helper (the rANS kernel and the engine's CPU kernels): libraries
go after the source, as the linker needs them, and are part of the cache key; a cached build is not
rebuilt; a failed build is an OSError."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from kvstore.c_build import build_library

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
FLAGS = ("-O2", "-shared", "-fPIC")


@pytest.fixture
def logged_cc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$CC is gcc behind a script that logs each command line it is given; returns the log."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec gcc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))
    return log


def _builds(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines() if line != "--version"]


def test_libraries_follow_the_source_and_key_the_cache(tmp_path: Path, logged_cc: Path) -> None:
    src = tmp_path / "root.c"
    src.write_text("#include <math.h>\ndouble root(double x) { return sqrt(x); }\n")
    plain = build_library(src, FLAGS)
    linked = build_library(src, FLAGS, libs=("-lm",))
    assert plain != linked and plain.is_file() and linked.is_file()
    assert linked.parent == tmp_path / "cache" / "kernels" and linked.name.startswith("root-")
    first, second = _builds(logged_cc)
    assert "-lm" not in first
    assert second[-1] == "-lm" and second.index(str(src)) < second.index("-lm")
    fn = ctypes.CDLL(str(linked)).root
    fn.argtypes, fn.restype = [ctypes.c_double], ctypes.c_double
    assert fn(9.0) == 3.0
    assert build_library(src, FLAGS, libs=("-lm",)) == linked  # cached: no third build
    assert len(_builds(logged_cc)) == 2


def test_a_failed_build_is_an_oserror(tmp_path: Path, logged_cc: Path) -> None:
    src = tmp_path / "broken.c"
    src.write_text("int broken( {\n")
    with pytest.raises(OSError, match="failed"):
        build_library(src, FLAGS)
    assert not list((tmp_path / "cache" / "kernels").glob("broken-*.so"))
