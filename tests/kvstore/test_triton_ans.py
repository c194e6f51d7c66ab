"""The Triton rANS decoder (triton_ans.py) against the C kernel and the Python reference: under
TRITON_INTERPRET=1 on CPU tensors (small streams: the interpreter takes ~3 ms a step of 8 codes), and
compiled on CUDA when a GPU is present (`-m gpu`).

The interpreter must be on before triton.language is first imported, which other test modules do
without it, so the cases run in one subprocess (`python -m tests.kvstore.test_triton_ans`) printing
one JSON line per case; each pytest test checks its line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvstore.codecs import ans, get_codec
from kvstore.errors import CodecError
from tests.kvstore.test_codecs import make_kv
from tests.triton_interpret import interpreted_errors, report

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not ans.kernel_available(), reason="no C compiler for the rANS kernel")


def _pack(syms: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    padded = np.zeros(-(-syms.size // per) * per, np.uint8)
    padded[: syms.size] = syms
    return np.bitwise_or.reduce([padded[k::per] << (k * bits) for k in range(per)]).astype(np.uint8)


def _stream(bits: int) -> tuple[bytes, list[int], list[np.ndarray]]:
    """Coded segments of n % 8 = 0 and not (a partial last byte at 2 and 4 bits), a raw one, one of a
    single symbol (frequency 4096), a 1-code and an empty segment."""
    rng = np.random.default_rng(bits)
    ns = [608, 1, 403, 96, 0, 397] if bits < 8 else [1208, 1, 1003, 96, 0, 1597]  # 8 bits: 512-byte tables
    skews = [0.3 / bits, 1.0, 0.1 / bits, 1e6, 1.0, 0.0]
    segs = []
    for n, skew in zip(ns, skews, strict=True):
        p = rng.dirichlet(np.full(1 << bits, skew)) if skew else np.eye(1 << bits)[1]
        segs.append(_pack(rng.choice(1 << bits, size=n, p=p).astype(np.uint8), bits))
    return ans.encode_segments(segs, ns, bits), ns, segs


def _modes(stream: bytes, ns: list[int], bits: int) -> list[int]:
    from kvstore.codecs import triton_ans  # noqa: PLC0415

    return triton_ans.parse(stream, ns, bits, [0] * len(ns)).info[:, 0].tolist()


def _both(
    stream: bytes, ns: list[int], bits: int, device: str
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(C, Triton) output bytes with gaps of 0xA5 between the segments, or None where CodecError."""
    offsets, pos = [], 3
    for n in ns:
        offsets.append(pos)
        pos += ans.packed_nbytes(n, bits) + 5
    outs: list[np.ndarray | None] = []
    for dev in (None, device):
        out = np.full(pos, 0xA5, np.uint8)
        try:
            if dev is None:
                ans.decode_into(stream, ns, bits, out, offsets)
            else:
                t = torch.from_numpy(out).to(dev)
                ans.decode_into(stream, ns, bits, t, offsets)
                out = t.cpu().numpy()
            outs.append(out)
        except CodecError:
            outs.append(None)
    return outs[0], outs[1]


def case_decode(bits: int, device: str) -> None:
    stream, ns, segs = _stream(bits)
    modes = _modes(stream, ns, bits)
    assert 0 in modes and modes.count(1) >= 2, modes  # coded and raw records both
    ref, out = _both(stream, ns, bits, device)
    assert ref is not None and out is not None
    assert np.array_equal(out, ref), f"{(out != ref).sum()} bytes differ from the C kernel"
    pyref = ans.decode_segments(stream, ns, bits, use_c=False)
    assert all(np.array_equal(a, b) for a, b in zip(pyref, segs, strict=True))


def _lane_table(stream: bytes, bits: int) -> int:
    """The offset of the first record's lane lengths (a coded first record)."""
    assert stream[0] == 1
    return 1 + 2 * (1 << bits) + 4


def case_damaged(device: str) -> None:
    """What only the decode finds is flagged on the device (a CodecError, as the C kernel's -1); what
    parsing finds, refused before any kernel runs; random mutations decided as the C kernel decides."""
    bits = 4
    stream, ns, _ = _stream(bits)
    lt = _lane_table(stream, bits)
    lens = np.frombuffer(stream[lt : lt + 32], "<u4").copy()
    shifted = lens.copy()
    shifted[0] -= 2  # lane 0 runs out of words (it would read lane 1's), lane 1 ends with one left
    shifted[1] += 2
    state = bytearray(stream)
    state[lt + 32] ^= 1  # lane 0's first state: its last state is not the encoder's start state
    word = bytearray(stream)
    word[lt + 32 + 4] ^= 0x10  # one of lane 0's words
    kernel_found = [
        stream[:lt] + shifted.astype("<u4").tobytes() + stream[lt + 32 :],
        bytes(state),
        bytes(word),
    ]
    for bad in kernel_found:
        from kvstore.codecs import triton_ans  # noqa: PLC0415

        triton_ans.parse(bad, ns, bits, [0] * len(ns))  # parses: only decoding finds the damage
        ref, out = _both(bad, ns, bits, device)
        assert ref is None and out is None, "a damaged rANS stream decoded"
    table = bytearray(stream)
    table[1] ^= 1  # the table no longer sums to 4096
    for bad in (stream[:-1], stream + b"\0", b"\2" + stream[1:], bytes(table), stream[: lt + 8]):
        ref, out = _both(bad, ns, bits, device)
        assert ref is None and out is None
    rng = np.random.default_rng(5)
    for _ in range(12):
        bad = bytearray(stream)
        at = int(rng.integers(len(bad)))
        bad[at] ^= 1 << int(rng.integers(8))
        ref, out = _both(bytes(bad), ns, bits, device)
        assert (ref is None) == (out is None), f"C and Triton disagree on a flip at byte {at}"
        assert ref is None or out is None or np.array_equal(ref, out)


def case_codec(codec: str, device: str, shape: tuple = (2, 1, 16, 1, 64)) -> None:
    """A blob's payload of real-looking KV through the codec's device path decodes to what its CPU
    path decodes to (the base codec's Triton kernels after the codes: int4, fp8 bit for bit)."""
    dtype = torch.bfloat16
    c = get_codec(codec)
    payload, params = c.encode(make_kv(shape, dtype, seed=3))
    ref = c.decode(payload, params, shape, dtype)
    out = c.decode_device(payload, params, shape, dtype, device).cpu()
    assert out.dtype == ref.dtype and torch.equal(out.view(torch.int16), ref.view(torch.int16))


CASES: dict[str, Callable[[str], None]] = {
    **{f"decode-{b}bit": (lambda dev, b=b: case_decode(b, dev)) for b in (2, 4, 8)},
    "damaged": case_damaged,
    **{f"codec-{c}": (lambda dev, c=c: case_codec(c, dev)) for c in ("int4+ans", "fp8+ans")},
    "codec-fp8+ans-odd-codes": lambda dev: case_codec("fp8+ans", dev, (2, 1, 3, 1, 5)),  # unaligned scales
}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return interpreted_errors("tests.kvstore.test_triton_ans")


@pytest.mark.parametrize("name", list(CASES))
def test_triton_rans_matches_the_c_kernel_interpreted(interpreted: dict[str, str], name: str) -> None:
    assert name in interpreted, f"the subprocess did not report {name}"
    assert interpreted[name] == "", interpreted[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_triton_rans_matches_the_c_kernel_on_cuda(name: str) -> None:
    importlib.import_module("kvstore.codecs.triton_ans")
    CASES[name]("cuda")


if __name__ == "__main__":
    report({name: (lambda case=case: case("cpu")) for name, case in CASES.items()})
