"""The connector's C kernels say so when they compile (issue 43: a first vLLM start in a new home
compiled them without a word): one INFO line as the compile starts, naming the source, about how long
it takes and where it is cached; nothing once cached."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from kvstore.connectors import layout_c

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


def test_a_first_build_logs_one_line_with_the_estimate_and_the_cache(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))  # a new home: nothing cached
    monkeypatch.delenv("KVSTORE_LAYOUT_KERNEL", raising=False)
    monkeypatch.delenv("CC", raising=False)
    layout_c._lib.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="kvstore.c_build"):
            assert layout_c._lib() is not None
        starting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")]
        assert starting == [f"compiling layout_kernels.c once, ~1 s; cached in {tmp_path / 'kernels'}"]
        assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".so"]
        caplog.clear()
        layout_c._lib.cache_clear()
        with caplog.at_level(logging.INFO, logger="kvstore.c_build"):
            assert layout_c._lib() is not None
        assert not [r for r in caplog.records if "compil" in r.getMessage()], "cached: no compile, no line"
    finally:
        layout_c._lib.cache_clear()  # the next caller loads from its own cache dir
