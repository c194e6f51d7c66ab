"""`kivi4` / `kivi2`: b-bit KV in the KIVI split with cheap metadata (codec ids 3 and 4).

Keys are quantised per channel across tokens (keys carry persistent outlier channels), values per
token per head; both asymmetric min-max, codes packed 8/b per byte (the lowest bits hold the first
element). What makes them smaller than `int4` (id 2, which stays readable) is the metadata: keys
share a group over many tokens, and a value group's scale and zero take 2 bytes, not 4. The defaults
were chosen by benchmarks/bench_codec_quality.py.

Options (`encode_blob(kv, codec="kivi4", key_tokens=..., ...)`):
    key_tokens:    tokens per key group (per channel); the last group of a chunk takes what is left.
                   Default 128 for kivi4 (two groups per channel of a 256-token chunk), 64 for kivi2.
    value_group:   channels per value group along the token's row of kv_heads * head_dim channels (it
                   must divide the row; "row": all of them); default head_dim: one group per head.
    value_meta:    "8bit" (default): one uint16 per value group: a zero point in 1/16 codes (0..2^b-1)
                   and a scale on a log grid of 2^(1/16) steps under an fp16 reference per layer and
                   group index (`v_ref`); "fp16": an fp16 scale and zero per group (4 bytes).
    key_meta:      "fp16": an fp16 scale and zero per key group (kivi2's default); "8bit" (kivi4's
                   default): one uint16 per key group as value_meta's 8bit (a 1/16-code zero point, a
                   log-grid scale) under an fp16 reference per layer and channel (`k_ref`): half the
                   bytes, so that key groups of 128 tokens cost what 256 did in fp16 (keys carry most of
                   kivi4's error: KL 0.0085 -> 0.0074 on SmolLM2, bench_codec_quality.py). Blobs of
                   the earlier kivi4 default (256 tokens, fp16) carry kt/km in their params and decode
                   as before.
    rotate_values: each head's value vector is multiplied by the orthonormal Hadamard matrix before
                   it is quantised, and back on decode (the matrix is its own inverse): outliers spread
                   over the group. Default: where it can (a power-of-two head_dim, value groups inside a head).
    sink_tokens:   the first `sink_tokens` KEYS of a chunk of >= 16 tokens are stored exactly, in the
                   KV dtype, and left out of their channel's group: the first token of a sequence is an
                   attention sink whose huge keys would stretch every channel's range (default 1).

Payload, in order: key codes `[L, T - sink, C*b/8]`, value codes `[L, T, C*b/8]` (C = kv_heads *
head_dim), key scale/zero fp16 pairs `[L, ceil((T - sink) / key_tokens), C, 2]` (8bit: uint16
`[L, groups, C]`, then the fp16 references `[L, C]`), the value metadata
(8bit: uint16 `[L, T, C / value_group]`, then the fp16 references `[L, C / value_group]`; fp16: pairs
`[L, T, C / value_group, 2]`), the sink keys' raw bits `[L, sink, C]`. At the defaults, for a
256-token SmolLM2-135M chunk (C = 192), header included: kivi4 3.77x smaller than bf16, kivi2 6.66x
(with the rANS stage, with_ans.py, about 4.0x and 7.9x: it depends on the data).

Error bound: |x - x'| <= scale/2 per element (keys: scale = fp16((max - min) / (2^b - 1)) of the
group; 8bit values: at most 2^(1/16) x (1 + 1/16) x that), plus the fp16 rounding of scale and zero
and the rounding to the KV dtype on decode; with rotate_values it holds in the rotated basis (the L2
error per vector is the same). NaN/Inf in the KV, or values past the fp16 range of the scales, raise
CodecError. The CPU path is torch, vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.codecs import common, cpu_kivi
from kvstore.errors import CodecError

DEFAULTS: dict[str, Any] = {
    "key_tokens": None, "value_group": None, "sink_tokens": 1, "value_meta": "8bit", "rotate_values": None,
    "key_meta": None,
}  # fmt: skip
KEY_TOKENS = {4: 128, 2: 64}  # the default key_tokens per width (bench_codec_quality.py chose them)
KEY_META = {4: "8bit", 2: "fp16"}  # the default key_meta per width
VALUE_META = ("fp16", "8bit")
_STEPS = 16  # 8bit value scales: r * 2^(-c / 16), c = 0..255 (steps of 4.4%)
_ZP = 16  # 8bit value zero points: multiples of 1/16 code, 0..2^b-1 (<= 240: 8 bits)
_POW = torch.tensor([2.0 ** (-c / _STEPS) for c in range(256)], dtype=torch.float32)
SINK_MIN_TOKENS = 16  # shorter chunks keep no sink keys
MAX_SINK_TOKENS = 64


@dataclass(frozen=True)
class KiviLayout:
    shape: tuple[int, int, int, int, int]
    bits: int
    key_tokens: int
    value_group: int
    sink: int
    itemsize: int
    value_meta: str = "fp16"
    rotate_values: bool = False
    key_meta: str = "fp16"

    @property
    def channels(self) -> int:
        return self.shape[3] * self.shape[4]

    @property
    def key_groups(self) -> int:
        return -(-(self.shape[2] - self.sink) // self.key_tokens)

    def params(self) -> dict:
        p = {"kt": self.key_tokens, "vg": self.value_group, "sink": self.sink}
        if self.value_meta != "fp16":
            p["vm"] = VALUE_META.index(self.value_meta)
        if self.rotate_values:
            p["rv"] = 1
        if self.key_meta != "fp16":
            p["km"] = VALUE_META.index(self.key_meta)
        return p

    @classmethod
    def from_params(cls, shape: tuple[int, ...], params: dict, dtype: torch.dtype, bits: int) -> KiviLayout:
        keys = set(params) - {"vm", "rv", "km"}
        if keys != {"kt", "vg", "sink"} or not all(type(v) is int for v in params.values()):
            raise CodecError(f"kivi: bad params {params!r:.80}")
        metas = range(len(VALUE_META))
        if params.get("vm", 0) not in metas or params.get("km", 0) not in metas or params.get("rv", 1) != 1:
            raise CodecError(f"kivi: bad params {params!r:.80}")
        meta, rot, kmeta = VALUE_META[params.get("vm", 0)], "rv" in params, VALUE_META[params.get("km", 0)]
        lay = cls(
            tuple(shape), bits, params["kt"], params["vg"], params["sink"], dtype.itemsize, meta, rot, kmeta
        )  # type: ignore[arg-type]
        lay.validate()
        return lay

    def validate(self) -> None:
        c, t = self.channels, self.shape[2]
        if c * self.bits % 8:
            raise CodecError(f"kivi{self.bits}: kv_heads * head_dim = {c} does not pack into bytes")
        if not 1 <= self.key_tokens <= 1 << 20:
            raise CodecError(f"kivi: key_tokens must be in 1..{1 << 20}, got {self.key_tokens}")
        if not 1 <= self.value_group <= c or c % self.value_group:
            raise CodecError(f"kivi: value_group {self.value_group} does not divide kv_heads * head_dim {c}")
        d = self.shape[4]
        if self.rotate_values and (d & (d - 1) or d % self.value_group):
            raise CodecError(
                f"kivi: rotate_values needs a power-of-two head_dim that value_group divides ({d})"
            )
        if not 0 <= self.sink <= min(MAX_SINK_TOKENS, t - 1 if t > 1 else 0):
            raise CodecError(f"kivi: sink_tokens {self.sink} out of range for {t} tokens")

    def sections(self) -> list[tuple[str, type, tuple[int, ...]]]:
        _, nl, nt, _, _ = self.shape
        c, row = self.channels, self.channels * self.bits // 8
        return [
            ("k_codes", np.uint8, (nl, nt - self.sink, row)),
            ("v_codes", np.uint8, (nl, nt, row)),
            *self._key_meta_sections(),
            *self._value_meta_sections(),
            ("sink", np.uint16 if self.itemsize == 2 else np.uint32, (nl, self.sink, c)),
        ]

    def _key_meta_sections(self) -> list[tuple[str, type, tuple[int, ...]]]:
        nl, g, c = self.shape[1], self.key_groups, self.channels
        if self.key_meta == "fp16":
            return [("k_sz", np.int16, (nl, g, c, 2))]  # float16 bits
        return [("k_meta", np.uint16, (nl, g, c)), ("k_ref", np.int16, (nl, c))]

    def _value_meta_sections(self) -> list[tuple[str, type, tuple[int, ...]]]:
        _, nl, nt, _, _ = self.shape
        g = self.channels // self.value_group
        if self.value_meta == "fp16":
            return [("v_sz", np.int16, (nl, nt, g, 2))]  # float16 bits
        return [("v_meta", np.uint16, (nl, nt, g)), ("v_ref", np.int16, (nl, g))]

    def nbytes(self) -> int:
        return common.sections_nbytes(self.sections())

    def carve(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        return common.carve(self.sections(), buf)


def layout_for(shape: tuple[int, ...], dtype: torch.dtype, bits: int, **options: Any) -> KiviLayout:
    o = common.take_options(f"kivi{bits}", options, DEFAULTS)
    d = int(shape[4])
    vg = {None: d, "row": int(shape[3]) * d}.get(o["value_group"], o["value_group"])
    if o["key_tokens"] is None:
        o["key_tokens"] = KEY_TOKENS[bits]
    if o["key_meta"] is None:
        o["key_meta"] = KEY_META[bits]
    if o["rotate_values"] is None:  # where it can: a power-of-two head_dim, groups inside a head
        o["rotate_values"] = d & (d - 1) == 0 and type(vg) is int and vg > 0 and d % vg == 0
    for name, v in (("key_tokens", o["key_tokens"]), ("value_group", vg), ("sink_tokens", o["sink_tokens"])):
        if type(v) is not int:
            raise CodecError(f"kivi{bits}: {name} must be an int, got {v!r}")
    if not isinstance(o["rotate_values"], bool):
        raise CodecError(f"kivi{bits}: rotate_values must be a bool, got {o['rotate_values']!r}")
    for name in ("value_meta", "key_meta"):
        if o[name] not in VALUE_META:
            raise CodecError(f"kivi{bits}: {name} must be one of {VALUE_META}, got {o[name]!r}")
    if not 0 <= o["sink_tokens"] <= MAX_SINK_TOKENS:
        raise CodecError(f"kivi{bits}: sink_tokens must be in 0..{MAX_SINK_TOKENS}, got {o['sink_tokens']}")
    sink = o["sink_tokens"] if int(shape[2]) >= max(SINK_MIN_TOKENS, o["sink_tokens"] + 1) else 0
    lay = KiviLayout(
        tuple(int(s) for s in shape),
        bits,
        o["key_tokens"],
        vg,
        sink,
        dtype.itemsize,
        o["value_meta"],
        o["rotate_values"],
        o["key_meta"],
    )  # type: ignore[arg-type]
    lay.validate()
    return lay


def _f16_bits(x: torch.Tensor, what: str) -> torch.Tensor:
    h = x.to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        raise CodecError(f"{what}: KV contains NaN, Inf or values beyond the float16 range of its scales")
    return h


def quantize(x: torch.Tensor, dim: int, bits: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantisation of float32 `x` in groups along `dim`: codes (uint8, x's shape)
    and the groups' fp16 (scale, zero): x's shape with `dim` of size 1, then a trailing axis of 2."""
    top = (1 << bits) - 1
    mn, mx = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    s16 = _f16_bits((mx - mn) / top, what)
    z16 = _f16_bits(mn, what)
    s, z = s16.float(), z16.float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = (x - z).mul_(inv).add_(0.5).floor_().clamp_(0, top).to(torch.uint8)
    return q, torch.stack([s16, z16], -1)


def quantize_8bit(x: torch.Tensor, bits: int, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups along the last dim of float32 `x` [L, T, G, n] with an integer zero point zp in
    0..2^b-1 and a scale on a log grid under a per-(layer, group index) fp16 reference r:
    x ~ (q - zp) * r * 2^(-c/16). Returns codes, meta (c | zp << 8, int32 [L, T, G], stored as uint16), r (fp16 [L, G])."""
    top = (1 << bits) - 1
    mn, mx = x.amin(-1), x.amax(-1)
    s0 = (mx - mn) / top
    flat = torch.where(mn < 0, float(top), 0.0)  # an all-equal group: its value at an end of the range
    u = torch.where(s0 > 0, -mn / torch.where(s0 > 0, s0, 1), flat).clamp_(0, top)

    def cover(zp: torch.Tensor) -> torch.Tensor:  # the scale with which zp's range holds [mn, mx]
        inf = torch.full_like(mx, torch.inf)  # zp = top holds no positive value, zp = 0 no negative one
        up = torch.where(zp < top, mx / (top - zp).clamp(min=1), torch.where(mx > 0, inf, 0))
        down = torch.where(zp > 0, -mn / zp.clamp(min=1), torch.where(mn < 0, inf, 0))
        return torch.maximum(up, down).clamp_(min=0)

    # the zero point on a grid of 1/16 code next to the exact one, whichever needs the smaller scale
    lo, hi = (u * _ZP).floor() / _ZP, (u * _ZP).ceil() / _ZP
    need_lo, need_hi = cover(lo), cover(hi)
    zp = torch.where(need_lo <= need_hi, lo, hi)
    need = torch.minimum(need_lo, need_hi)
    top_need = need.amax(1)  # [L, G]
    r16 = _f16_bits(top_need, what)
    bumped = (r16.view(torch.int16) + 1).view(torch.float16)  # the next float16 up (r16 >= 0)
    r16 = torch.where(r16.float() < top_need, bumped, r16)
    r = r16.float()[:, None]
    if not bool(torch.isfinite(r).all()):
        raise CodecError(f"{what}: KV contains NaN, Inf or values beyond the float16 range of its scales")
    ratio = torch.where(need > 0, need / torch.where(r > 0, r, 1), 0)
    c = torch.where(ratio > 0, (-_STEPS * torch.log2(ratio.clamp(min=1e-30))).floor(), 255).clamp_(0, 255)
    c = c.long()
    s = (_POW[c] * r).clamp(min=0)
    c = torch.where(s < need, (c - 1).clamp(min=0), c)  # float rounding: never a scale below the need
    s = _POW[c] * r
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = (x * inv[..., None]).add_(zp[..., None]).round_().clamp_(0, top).to(torch.uint8)
    meta = (c | ((zp * _ZP).round().long() << 8)).to(torch.int32)
    return q, meta, r16


def dequantize_8bit(q: torch.Tensor, meta: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    m = meta.to(torch.int32)
    s = _POW[m & 255] * r16.float()[:, None]
    zp = (m >> 8).float() / _ZP
    return (q.float() - zp[..., None]) * s[..., None]


def dequantize(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    s, z = sz[..., 0].float(), sz[..., 1].float()
    return q.float() * s + z


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., n) -> (..., n*bits/8) bytes, the first code in the lowest bits."""
    per = 8 // bits
    q = q.reshape(*q.shape[:-1], -1, per)
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (i * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(per)]
    return torch.stack(parts, -1).reshape(*packed.shape[:-1], -1)


def _key_groups(k: torch.Tensor, kt: int) -> list[tuple[int, int]]:
    n = k.shape[1]
    return [(a, min(a + kt, n)) for a in range(0, n, kt)]


class KiviCodec:
    def __init__(self, bits: int, codec_id: int) -> None:
        self.bits, self.codec_id, self.name = bits, codec_id, f"kivi{bits}"

    def encode(self, kv: torch.Tensor, **options: Any) -> tuple[memoryview, dict]:
        kv = common.check_kv(kv, self.name).cpu().contiguous()
        lay = layout_for(tuple(kv.shape), kv.dtype, self.bits, **options)
        # NaN/Inf reach every group's min or max, so quantize's check of the scales finds them; the
        # sink keys are stored as they are, so they are checked here
        if lay.sink and not bool(torch.isfinite(kv[0, :, : lay.sink]).all()):
            raise CodecError(f"{self.name}: KV contains NaN or Inf")
        buf = np.empty(lay.nbytes(), np.uint8)
        parts = lay.carve(buf)
        # codes through torch; 16-bit sections through numpy, which writes them at any alignment (torch
        # over an odd address wrote garbage: kv_heads * head_dim * bits / 8 odd, an odd token count)
        p = {n: torch.from_numpy(parts[n]) for n in ("k_codes", "v_codes")}
        _, nl, nt, nh, d = lay.shape
        c = nh * d
        x = kv.reshape(2, nl, nt, c)
        keys, values = x[0, :, lay.sink :].float(), x[1].float()
        if lay.key_meta == "fp16":
            for g, (a, b) in enumerate(_key_groups(keys, lay.key_tokens)):
                q, sz = quantize(keys[:, a:b], 1, self.bits, self.name)  # per channel over tokens a..b
                p["k_codes"][:, a:b] = pack(q, self.bits)
                parts["k_sz"][:, g] = sz[:, 0].view(torch.int16).numpy()
        else:  # [L, groups, C, key_tokens]: the last group padded with its last token (same min, max)
            n, kt = keys.shape[1], lay.key_tokens
            padded = torch.cat([keys, keys[:, -1:].expand(nl, lay.key_groups * kt - n, c)], 1)
            grouped_k = padded.reshape(nl, lay.key_groups, kt, c).transpose(2, 3)
            kq, kmeta, kref = quantize_8bit(grouped_k, self.bits, self.name)
            p["k_codes"][:] = pack(kq.transpose(2, 3).reshape(nl, -1, c)[:, :n], self.bits)
            parts["k_meta"][:] = kmeta.numpy().astype(np.uint16)
            parts["k_ref"][:] = kref.view(torch.int16).numpy()
        if lay.rotate_values:  # each head's value vector in the Hadamard basis (orthonormal)
            values = (values.reshape(nl, nt, nh, d) @ common.hadamard(d)).reshape(nl, nt, c)
        grouped = values.reshape(nl, nt, c // lay.value_group, lay.value_group)
        if lay.value_meta == "fp16":
            vq, vsz = quantize(grouped, 3, self.bits, self.name)
            parts["v_sz"][:] = vsz[..., 0, :].view(torch.int16).numpy()
        else:
            vq, meta, ref = quantize_8bit(grouped, self.bits, self.name)
            parts["v_meta"][:] = meta.numpy().astype(np.uint16)
            parts["v_ref"][:] = ref.view(torch.int16).numpy()
        p["v_codes"][:] = pack(vq.reshape(nl, nt, c), self.bits)
        if lay.sink:
            parts["sink"][:] = common.bits(x[0, :, : lay.sink].contiguous())
        return memoryview(buf), lay.params()

    def payload_nbytes(self, params: dict, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        shape = common.check_shape(shape, dtype, self.name)
        return KiviLayout.from_params(shape, params, dtype, self.bits).nbytes()

    def decode(
        self,
        payload: bytes | bytearray | memoryview,
        params: dict,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Decode to a CPU tensor, or with `device="cuda"` on the GPU through the Triton kernel."""
        shape = common.check_shape(shape, dtype, self.name)
        lay = KiviLayout.from_params(shape, params, dtype, self.bits)
        if len(payload) != lay.nbytes():
            raise CodecError(
                f"{self.name}: payload is {len(payload)} bytes, shape {shape} needs {lay.nbytes()}"
            )
        if device is not None and torch.device(device).type == "cuda":
            from kvstore.codecs import triton_kivi  # noqa: PLC0415 (Triton: only on this path)

            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
            return triton_kivi.kivi_decode(buf, lay, dtype).reshape(shape)
        parts = lay.carve(common.payload_array(payload))
        out, ob = common.empty_bits((2, lay.shape[1], lay.shape[2], lay.channels), dtype)
        if not cpu_kivi.decode(parts, lay, common.KINDS[dtype], ob, _POW.numpy()):  # no compiler: torch
            _decode_torch(parts, lay, self.bits, out)
        if lay.sink:
            ob[0, :, : lay.sink] = parts["sink"]
        return out.reshape(shape) if device is None else out.reshape(shape).to(device)


def _decode_torch(parts: dict[str, np.ndarray], lay: KiviLayout, bits: int, out: torch.Tensor) -> None:
    p = {n: torch.from_numpy(a.copy()) for n, a in parts.items() if n not in ("sink", "v_meta", "k_meta")}
    _, nl, nt, nh, d = lay.shape
    c = nh * d
    dtype = out.dtype
    kq = unpack(p["k_codes"], bits)
    if lay.key_meta == "fp16":
        ksz = p["k_sz"].view(torch.float16)
        for g, (a, b) in enumerate(_key_groups(kq, lay.key_tokens)):
            out[0, :, lay.sink + a : lay.sink + b] = dequantize(kq[:, a:b], ksz[:, g : g + 1]).to(dtype)
    else:
        n, kt = kq.shape[1], lay.key_tokens
        padded = torch.cat([kq, kq.new_zeros(nl, lay.key_groups * kt - n, c)], 1)
        grouped_k = padded.reshape(nl, lay.key_groups, kt, c).transpose(2, 3)
        meta = torch.from_numpy(parts["k_meta"].astype(np.int32))
        k = dequantize_8bit(grouped_k, meta, p["k_ref"].view(torch.float16))
        out[0, :, lay.sink :] = k.transpose(2, 3).reshape(nl, -1, c)[:, :n].to(dtype)
    vq = unpack(p["v_codes"], bits).reshape(nl, nt, c // lay.value_group, lay.value_group)
    if lay.value_meta == "fp16":
        v = dequantize(vq, p["v_sz"].view(torch.float16)[..., None, :])
    else:
        v = dequantize_8bit(
            vq, torch.from_numpy(parts["v_meta"].astype(np.int32)), p["v_ref"].view(torch.float16)
        )
    if lay.rotate_values:
        v = common.hadamard_rows(v.reshape(nl, nt, nh, d))  # the butterflies of cpu_kivi, in their order
    out[1] = v.reshape(nl, nt, c).to(dtype)
