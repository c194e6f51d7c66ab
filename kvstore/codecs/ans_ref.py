"""rANS in Python: the reference of ans_kernels.c (the same algorithm, stream and checks, bit for bit:
8 lanes, each with its own stream), and the fallback where no C compiler is found (slow: ~1 µs a symbol)."""

from __future__ import annotations

import numpy as np

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
LOW = 1 << 16
LANES = 8


def _symbols(codes: np.ndarray, n: int, bits: int) -> np.ndarray:
    per = 8 // bits
    parts = [(codes >> (i * bits)) & ((1 << bits) - 1) for i in range(per)]
    return np.stack(parts, -1).reshape(-1)[:n]


def _cum(freq: np.ndarray) -> list[int] | None:
    cum, c = [], 0
    for f in freq.tolist():
        cum.append(c)
        c += f
    return cum if c == PROB_SCALE else None


def encode(codes: np.ndarray, n: int, bits: int, freq: np.ndarray) -> bytes | None:
    """The stream of n packed symbols, or None (a bad table, a symbol of frequency 0)."""
    cum, f = _cum(freq), freq.tolist()
    if cum is None:
        return None
    syms = _symbols(codes, n, bits).tolist()
    lanes: list[bytes] = []
    for lane in range(LANES):
        x, words = LOW, []  # words in the encoder's order; the stream holds them reversed
        for i in reversed(range(lane, n, LANES)):
            s = syms[i]
            if f[s] == 0:
                return None
            if x >= ((LOW >> PROB_BITS) << 16) * f[s]:
                words.append(x & 0xFFFF)
                x >>= 16
            x = ((x // f[s]) << PROB_BITS) + (x % f[s]) + cum[s]
        lanes.append(np.array([x], "<u4").tobytes() + np.array(words[::-1], "<u2").tobytes())
    return np.array([len(b) for b in lanes], "<u4").tobytes() + b"".join(lanes)


def decode(data: bytes | memoryview, n: int, bits: int, freq: np.ndarray) -> np.ndarray | None:
    """n symbols packed `bits` wide, or None for a damaged stream or a bad table."""
    cum, f = _cum(freq), freq.tolist()
    data = bytes(data)
    if bits not in (2, 4, 8) or cum is None or len(data) < 4 * LANES:
        return None
    lut = np.repeat(np.arange(len(f)), f).tolist()
    x, streams, pos = [], [], 4 * LANES
    for m in np.frombuffer(data[: 4 * LANES], "<u4").tolist():
        if m < 4 or m > len(data) - pos or m % 2:  # a lane is its state and whole 16-bit words
            return None
        x.append(int(np.frombuffer(data[pos : pos + 4], "<u4")[0]))
        streams.append(np.frombuffer(data[pos + 4 : pos + m], "<u2").tolist())
        pos += m
    if pos != len(data):
        return None
    at, syms = [0] * LANES, [0] * n
    for i in range(n):
        lane = i % LANES
        v = x[lane]
        slot = v & (PROB_SCALE - 1)
        s = lut[slot]
        v = f[s] * (v >> PROB_BITS) + slot - cum[s]
        if v < LOW:
            if at[lane] == len(streams[lane]):
                return None
            v = (v << 16) | streams[lane][at[lane]]
            at[lane] += 1
        x[lane] = v
        syms[i] = s
    if any(v != LOW for v in x) or any(a != len(w) for a, w in zip(at, streams, strict=True)):
        return None
    per = 8 // bits
    padded = np.zeros(-(-n // per) * per, np.uint8)
    padded[:n] = syms
    out = np.zeros(len(padded) // per, np.uint8)
    for k in range(per):
        out |= padded[k::per] << (k * bits)
    return out
