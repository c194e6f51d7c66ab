"""Where the SGLang venv of these tests is (`make sglang-env`) and how to run SGLang in it on CPU.

The tests run in the project's venv and drive SGLang in a subprocess of `.venv/sglang/bin/python`:
SGLang itself (without its CUDA dependencies) over the project's packages. Its caches (the C++ page
hash it compiles, torch inductor's) go under `.venv/sglang/cache`, never `~/.cache`.
"""

from __future__ import annotations

import enum
import importlib.machinery
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SGL_VENV = ROOT / ".venv" / "sglang"
SGL_PYTHON = SGL_VENV / "bin" / "python"
CACHE = SGL_VENV / "cache"


def available() -> bool:
    return (SGL_VENV / ".installed").is_file() and SGL_PYTHON.is_file()


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def env() -> dict[str, str]:
    """The environment of an SGLang subprocess: this checkout importable, SGLang's caches under the venv."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "SGLANG_"))}
    out.update(
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        SGLANG_CACHE_DIR=str(CACHE / "sglang"),
        TORCH_EXTENSIONS_DIR=str(CACHE / "torch_extensions"),
        TORCHINDUCTOR_CACHE_DIR=str(CACHE / "inductor"),
        OMP_NUM_THREADS=out.get("OMP_NUM_THREADS", "2"),
    )
    return out


def import_sglang() -> None:
    """Import SGLang's HiCache modules on a machine without torchvision.

    `sglang.srt.configs` imports `torchvision.transforms` at module level (two vision configs) on the way
    to `memory_pool`; torchvision's wheels are CUDA builds that do not load beside the CPU torch. So a
    stand-in torchvision is in `sys.modules` while that package is imported, and only then: afterwards
    transformers (which asks `find_spec("torchvision")` whether to import its vision code) sees none,
    as in the project's venv. Its lazy classes that SGLang's configs import are resolved before."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor  # noqa: F401, PLC0415

    stubs = _torchvision_stand_in()
    sys.modules.update(stubs)
    try:
        import sglang.srt.configs  # noqa: F401, PLC0415
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
    import sglang.srt.managers.cache_controller  # noqa: F401, PLC0415
    import sglang.srt.mem_cache.memory_pool  # noqa: F401, PLC0415


def _torchvision_stand_in() -> dict[str, types.ModuleType]:
    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    tv = types.ModuleType("torchvision")
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    tv.__path__, tr.__path__ = [], []
    tr.InterpolationMode = fn.InterpolationMode = InterpolationMode
    tr.functional, tv.transforms = fn, tr
    for m in (tv, tr, fn):
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    return {m.__name__: m for m in (tv, tr, fn)}
