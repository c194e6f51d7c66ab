"""The int4 payload layout: which sections an encoded chunk holds, and which parts are quantised per
token (row jobs). Shared by the CPU path (int4.py + cpu_int4.py) and the Triton kernels
(triton_kernels.py), so neither depends on the other. The format itself is documented in int4.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.codecs import common
from kvstore.errors import CodecError

DEFAULTS: dict[str, Any] = {
    "group_size": 64, "key_group_size": None, "keys": "channel", "rotate": False, "sink_tokens": 1,
}  # fmt: skip
MAX_SINK_TOKENS = 64
SINK_MIN_TOKENS = 16  # shorter chunks keep no sink tokens (they would cost more than they save)
GROUP_SIZES = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Int4Layout:
    """Where each part of an int4 payload lives, for one KV shape and parameter set."""

    shape: tuple[int, int, int, int, int]
    group: int
    key_group: int
    keys: str
    rotate: bool
    sink: int  # leading tokens also stored exactly (min(sink_tokens, T))
    itemsize: int  # of the KV dtype

    @classmethod
    def from_params(cls, shape: tuple[int, ...], params: dict, dtype: torch.dtype) -> Int4Layout:
        if set(params) != {"g", "kg", "keys", "rot", "sink"}:
            raise CodecError(f"int4: bad params {params!r:.80}")
        try:
            g, kg, keys, rot, sink = (params[k] for k in ("g", "kg", "keys", "rot", "sink"))
            lay = cls(tuple(shape), int(g), int(kg), str(keys), bool(rot), int(sink), dtype.itemsize)
        except (KeyError, TypeError, ValueError):
            raise CodecError(f"int4: bad params {params!r}") from None
        lay.validate()
        return lay

    def params(self) -> dict:
        return {
            "g": self.group,
            "kg": self.key_group,
            "keys": self.keys,
            "rot": int(self.rotate),
            "sink": self.sink,
        }

    def validate(self) -> None:
        _, _, _, _, d = self.shape
        if self.keys not in ("channel", "token"):
            raise CodecError(f"int4: keys must be 'channel' or 'token', got {self.keys!r}")
        for name, g in (("group_size", self.group), ("key_group_size", self.key_group)):
            if g not in GROUP_SIZES:
                raise CodecError(f"int4: {name} must be one of {GROUP_SIZES}, got {g!r}")
        if d % self.group:
            raise CodecError(f"int4: group_size {self.group} does not divide head_dim {d}")
        if self.keys == "token" and d % self.key_group:
            raise CodecError(f"int4: key_group_size {self.key_group} does not divide head_dim {d}")
        if self.rotate and d & (d - 1):
            raise CodecError(f"int4: rotate needs a power-of-two head_dim, got {d}")
        if not 0 <= self.sink <= min(self.shape[2], MAX_SINK_TOKENS):
            raise CodecError(f"int4: sink_tokens must be in 0..{MAX_SINK_TOKENS}, got {self.sink}")

    @property
    def full_tokens(self) -> int:
        """Tokens whose keys are grouped per channel (0 with keys='token')."""
        t = self.shape[2]
        return t - t % self.key_group if self.keys == "channel" else 0

    def sections(self) -> list[tuple[str, type, tuple[int, ...]]]:
        _, nl, nt, nh, d = self.shape
        tf = self.full_tokens
        out = [
            ("codes", np.uint8, (2, nl, nt, nh, d // 2)),
            ("v_sz", np.uint16, (nl, nt, nh, d // self.group, 2)),
        ]
        if self.keys == "channel":
            out += [("k_sz", np.uint16, (nl, tf // self.key_group, nh * d, 2)),
                    ("k_tail_sz", np.uint16, (nl, nt - tf, nh, d // self.group, 2))]  # fmt: skip
        else:
            out += [("k_sz", np.uint16, (nl, nt, nh, d // self.key_group, 2))]
        out.append(("sink", np.uint16 if self.itemsize == 2 else np.uint32, (2, nl, self.sink, nh, d)))
        return out

    def nbytes(self) -> int:
        return common.sections_nbytes(self.sections())

    def carve(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        return common.carve(self.sections(), buf)


def layout_for(shape: tuple[int, ...], dtype: torch.dtype = torch.float16, **options: Any) -> Int4Layout:
    """The layout `encode` would use for this shape and options (raises CodecError on bad options)."""
    o = common.take_options("int4", options, DEFAULTS)
    if not isinstance(o["rotate"], bool):
        raise CodecError(f"int4: rotate must be a bool, got {o['rotate']!r}")
    if not isinstance(o["sink_tokens"], int) or not 0 <= o["sink_tokens"] <= MAX_SINK_TOKENS:
        raise CodecError(
            f"int4: sink_tokens must be an int in 0..{MAX_SINK_TOKENS}, got {o['sink_tokens']!r}"
        )
    kg = o["group_size"] if o["key_group_size"] is None else o["key_group_size"]
    sink = o["sink_tokens"] if int(shape[2]) >= max(SINK_MIN_TOKENS, o["sink_tokens"]) else 0
    lay = Int4Layout(
        tuple(int(s) for s in shape), o["group_size"], kg, o["keys"], o["rotate"], sink, dtype.itemsize
    )  # type: ignore[arg-type]
    lay.validate()
    return lay


def row_jobs(lay: Int4Layout) -> list[tuple[int, slice, int, str]]:
    """(kv half, token slice, group, scale/zero section) for every part quantised per token."""
    nt, tf = lay.shape[2], lay.full_tokens
    jobs = [(1, slice(0, nt), lay.group, "v_sz")]
    if lay.keys == "token":
        jobs.append((0, slice(0, nt), lay.key_group, "k_sz"))
    elif tf < nt:
        jobs.append((0, slice(tf, nt), lay.group, "k_tail_sz"))
    return jobs
