"""On a CUDA machine: run the gpu tier tests and the vLLM connector's CUDA tests, then print the gpu
tier's put/get GB/s side by side with a raw pinned host<->device copy and a device-to-device copy of
the same size, measured in this run.

    python benchmarks/gpu_check.py [--sizes-mib 1 4 16 64] [--reps 10] [--skip-tests]

Without CUDA it says so and exits 0 (nothing to check).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of fn() over reps runs (after one warm-up), with the device synchronised."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_tests() -> int:
    """The gpu tier tests, then the vLLM connector tests on CUDA (their [cuda] variants and the CUDA
    layout test; they need vLLM's CUDA build: `pip install vllm`, the [cpu] variants then skip)."""
    rc = 0
    for target in ("tests/kvstore/test_gpu_tier.py", "tests/connectors/vllm"):
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", target]
        print("$", " ".join(cmd), flush=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        rc = rc or subprocess.run(cmd, cwd=ROOT, env=env).returncode
    return rc


def bench(sizes_mib: list[int], reps: int) -> None:
    from kvstore.tiers.gpu import GpuTier

    torch.set_num_threads(1)
    dev = torch.device("cuda")
    print(
        f"\ndevice: {torch.cuda.get_device_name(dev)}  torch {torch.__version__}  CUDA {torch.version.cuda}"
    )
    header = f"{'size':>8} | {'tier put':>9} {'tier get':>9} | {'pinned H2D':>10} {'pinned D2H':>10} | {'D2D copy':>9} | put/H2D get/D2H"
    print(header + "\n" + "-" * len(header))
    for mib in sizes_mib:
        n = mib * 2**20
        tier = GpuTier(capacity=4 * n)
        blob = os.urandom(n)
        put_s = timed(lambda blob=blob, tier=tier: tier.put("0" * 32, blob), reps)
        get_s = timed(lambda tier=tier: tier.get("0" * 32), reps)
        assert bytes(tier.get("0" * 32)) == blob, "gpu tier returned different bytes"
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        a = torch.empty(n, dtype=torch.uint8, device=dev)
        b = torch.empty(n, dtype=torch.uint8, device=dev)
        h2d_s = timed(lambda a=a, host=host: a.copy_(host, non_blocking=True), reps)
        d2h_s = timed(lambda a=a, host=host: host.copy_(a, non_blocking=True), reps)
        d2d_s = timed(lambda a=a, b=b: b.copy_(a), reps)
        gbs = [n / s / 1e9 for s in (put_s, get_s, h2d_s, d2h_s, d2d_s)]
        print(
            f"{mib:>5}MiB | {gbs[0]:>7.2f}GB/s {gbs[1]:>7.2f}GB/s | {gbs[2]:>8.2f}GB/s {gbs[3]:>8.2f}GB/s |"
            f" {gbs[4]:>7.1f}GB/s | {gbs[0] / gbs[2]:>7.2f} {gbs[1] / gbs[3]:>7.2f}"
        )
        tier.close()
        del a, b, host
    print(
        "\ntier put/get include the host-side memcpy through the pinned staging buffers (bytes in, bytes out);"
    )
    print("pinned H2D/D2H are the raw DMA ceiling; D2D is device memory bandwidth (read+write counted once).")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the gpu tier tests skip on this machine)")
        return 0
    rc = 0 if args.skip_tests else run_tests()
    bench(args.sizes_mib, args.reps)
    return rc


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
