"""Real file-system faults for tests: a small tmpfs that fills up (ENOSPC), a process with few file
descriptors (EMFILE). No mocks: the kernel says no."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(size: str = "4m") -> Iterator[Path]:
    """A fresh tmpfs of `size` mounted on a temp directory, unmounted afterwards. Skips the test (with
    the reason) where mounting is refused: it needs root or CAP_SYS_ADMIN."""
    mnt = Path(tempfile.mkdtemp(prefix="kvstore-tmpfs-"))
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        mnt.rmdir()
        pytest.skip(
            f"cannot mount a {size} tmpfs for a real ENOSPC: {proc.stderr.strip() or proc.returncode}"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
        with contextlib.suppress(OSError):
            mnt.rmdir()
