"""Compile a C source of this project into a shared library on first use, cached under
`$KVSTORE_CACHE_DIR/kernels` (default `~/.cache/kvstore/kernels`), keyed by the source, the flags,
the libraries, the compiler's version and `extra_key`; written to a temp name, then renamed
(concurrent builders are safe). A build logs one INFO line as it starts ("compiling X once, ~N s;
cached in DIR": why a first start in a new home is slower) and one when done. Raises OSError without a C compiler (`$CC`, `cc` or `gcc`) or when
it fails. The one build helper: the rANS kernel (`kvstore/codecs/ans.py`) and the engine's CPU
kernels (`engine/layers/cpu_lib.py`) both build through it."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def build_library(
    src: Path,
    flags: tuple[str, ...],
    extra_key: str = "",
    libs: tuple[str, ...] = (),
    expect_s: float | None = None,
) -> Path:
    """The path of `src` built with `flags`, linked with `libs` (e.g. `("-lm",)`, given after the
    source as the linker needs them); `extra_key` is whatever else the build depends on (e.g. the
    CPU's flags for `-march=native`); `expect_s`, about how long the compile takes (said in the log
    line that announces it)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (set CC, or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except subprocess.SubprocessError as e:
        raise OSError(f"{cc} --version: {e}") from None
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (src.read_text(), " ".join((*flags, *libs)), version, extra_key))
    ).hexdigest()[:16]
    root = os.environ.get("KVSTORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvstore")
    out = Path(root) / "kernels" / f"{src.stem}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    about = f", ~{expect_s:.2g} s" if expect_s else ""
    logger.info("compiling %s once%s; cached in %s", src.name, about, out.parent)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        try:
            r = subprocess.run(
                [cc, *flags, str(src), "-o", str(so), *libs], capture_output=True, text=True, timeout=300
            )
        except subprocess.SubprocessError as e:
            raise OSError(f"{cc}: {e}") from None
        if r.returncode != 0:
            raise OSError(f"{cc} failed: {r.stderr[-2000:]}")
        os.replace(so, out)  # atomic: a concurrent build by another process wins or loses whole
    logger.info("compiled %s in %.1f s", out, time.monotonic() - started)
    return out


def load_library(
    src: Path, flags: tuple[str, ...], switch: str, fallback: str, expect_s: float | None = None
) -> ctypes.CDLL | None:
    """`src` built (`build_library`, `expect_s` its compile time) and loaded; None when the environment
    variable `switch` is "0", or when it cannot be built (logged as a warning that says what serves
    instead: `fallback`)."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(build_library(src, flags, expect_s=expect_s)))
    except OSError as e:
        logger.warning("%s unavailable (%s): %s", src.name, e, fallback)
        return None
