"""On a CUDA machine: run the gpu tier tests, the vLLM connector's CUDA tests and the codecs' Triton
tests, then print the gpu tier's put/get GB/s side by side with a raw pinned host<->device copy and a
device-to-device copy of the same size, and the codecs' Triton decodes (rANS stage, kivi, `+ans`)
against their CPU decodes: GB/s of KV out and whether they agree, measured in this run.

    python benchmarks/gpu_check.py [--sizes-mib 1 4 16 64] [--reps 10] [--skip-tests] [--skip-codecs]
    python benchmarks/gpu_check.py --interpret   # no GPU: the codec check on tiny shapes, interpreted

Without CUDA it says so and exits 0 (nothing to check); `--interpret` runs the codec check's code
under TRITON_INTERPRET=1 on CPU tensors (slow: it checks the script, not the kernels' speed).
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
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_tests() -> int:
    """The gpu tier tests, then the vLLM connector tests on CUDA (their [cuda] variants and the CUDA
    layout test; they need vLLM's CUDA build: `pip install vllm`, the [cpu] variants then skip)."""
    rc = 0
    targets = ("tests/kvstore/test_gpu_tier.py", "tests/connectors/vllm", "tests/kvstore/test_codecs_triton.py",
               "tests/kvstore/test_triton_ans.py", "tests/kvstore/test_triton_kivi.py",
               "tests/kvstore/test_triton_compile.py")  # fmt: skip
    for target in targets:
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


CODECS = ("int4+ans", "fp8+ans", "kivi4+ans", "kivi2+ans", "kivi4", "kivi2")


def _kv(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """KV with what real keys have: an outlier channel and a big first token (tests' make_kv)."""
    kv = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    kv[0, ..., 3] *= 12
    kv[0, :, 0] *= 8
    return kv.to(dtype)


def _agree(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    """(bit for bit, in words: else how many differ and by how much)."""
    ib = torch.int32 if ref.dtype == torch.float32 else torch.int16
    if torch.equal(out.view(ib), ref.view(ib)):
        return True, "bit for bit"
    o, r = out.float(), ref.float()
    return (
        False,
        f"DIFFERENT: {(o != r).float().mean().item():.2%} of values, max error {(o - r).abs().max().item():.3g}",
    )


def codec_check(device: str, shape: tuple[int, ...], reps: int) -> int:
    """Each codec's decode from host payload bytes to a device tensor (Triton) vs its CPU decode
    (to a CPU tensor), then the rANS stage alone (device stream -> device codes vs the C kernel).
    Returns how many are not bit for bit (the kernels do the CPU decodes' float32 operations in their
    order, the Hadamard butterflies included)."""
    from kvstore.codecs import ans, get_codec, triton_ans, triton_kivi
    from kvstore.codecs.kivi import KiviLayout

    dtype, bad = torch.bfloat16, 0
    kv = _kv(shape, dtype)
    nbytes = kv.numel() * kv.element_size()
    print(f"\ncodec decodes, KV {shape} {dtype} ({nbytes / 2**20:.1f} MiB), GB/s of KV out, device {device}")
    header = f"{'codec':>10} | {'CPU':>7} {'Triton':>7} {'ratio':>6} | agreement"
    print(header + "\n" + "-" * len(header))
    for name in CODECS:
        c = get_codec(name)
        payload, params = c.encode(kv)
        ref = c.decode(payload, params, shape, dtype)
        if name.endswith("+ans"):

            def dev(c=c, payload=payload, params=params):  # noqa: ANN202
                return c.decode_device(payload, params, shape, dtype, device)
        else:
            lay = KiviLayout.from_params(shape, params, dtype, c.bits)

            def dev(payload=payload, lay=lay):  # noqa: ANN202
                buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
                return triton_kivi.kivi_decode(buf, lay, dtype)

        same, agree = _agree(dev().cpu(), ref)
        bad += not same
        cpu_s = timed(
            lambda c=c, payload=payload, params=params: c.decode(payload, params, shape, dtype), reps
        )
        dev_s = timed(dev, reps)
        print(
            f"{name:>10} | {nbytes / cpu_s / 1e9:>7.2f} {nbytes / dev_s / 1e9:>7.2f} {cpu_s / dev_s:>6.2f} | {agree}"
        )
    c = get_codec("kivi2+ans")
    payload, params = c.encode(kv)
    _, n, bits, ns, at, _, total = c._plan(memoryview(payload), params, shape, dtype)
    stream = bytes(memoryview(payload)[:n])
    ref_codes = torch.zeros(total, dtype=torch.uint8)
    ans.decode_into(stream, ns, bits, ref_codes.numpy(), at)
    src = torch.frombuffer(bytearray(stream), dtype=torch.uint8).to(device)
    out = torch.zeros(total, dtype=torch.uint8, device=device)
    plan = triton_ans.parse(stream, ns, bits, at)
    triton_ans.decode_plan(src, plan, out)
    same = torch.equal(out.cpu(), ref_codes)
    bad += not same
    code_bytes = sum((k * bits + 7) // 8 for k in ns)
    c_s = timed(lambda: ans.decode_into(stream, ns, bits, ref_codes.numpy(), at), reps)
    dev_s = timed(lambda: triton_ans.decode_plan(src, plan, out), reps)
    print(f"\nrANS stage alone (kivi2+ans's stream, {len(ns)} segments, {code_bytes / 2**20:.2f} MiB of codes):"
          f" C {code_bytes / c_s / 1e9:.2f} GB/s, Triton {code_bytes / dev_s / 1e9:.3f} GB/s,"
          f" {'bit for bit' if same else 'DIFFERENT CODES'}")  # fmt: skip
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-codecs", action="store_true")
    parser.add_argument("--interpret", action="store_true", help="the codec check only, on CPU, interpreted")
    parser.add_argument("--codec-shape", type=int, nargs=5, default=[2, 30, 256, 3, 64])  # SmolLM2-135M chunk
    args = parser.parse_args()
    if args.interpret:
        assert "triton.language" not in sys.modules, "TRITON_INTERPRET must be set before triton is imported"
        os.environ["TRITON_INTERPRET"] = "1"
        return int(codec_check("cpu", (2, 1, 16, 1, 64), 1) > 0)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the gpu tier tests skip on this machine)")
        return 0
    rc = 0 if args.skip_tests else run_tests()
    bench(args.sizes_mib, args.reps)
    if not args.skip_codecs:
        rc = rc or int(codec_check("cuda", tuple(args.codec_shape), args.reps) > 0)
    return rc


if __name__ == "__main__":
    from provenance import recorded  # benchmarks/ is sys.path[0]

    recorded(main)
