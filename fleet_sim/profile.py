"""Cost profiles: small JSON files under profiles/, every number `{"value": ..., "source": "..."}`.

    kv_bytes_per_token      KV of one token, all layers, K and V
    prefill_s_per_token     compute per uncached prompt token
    prefill_s_per_token_ctx and per token of context before it (attention; optional, default 0)
    prefill_step_s          fixed cost of a step that prefills
    save_s_per_token        engine time per computed token it also saves to the store (optional, 0)
    decode_step_s           {batch size: seconds of one decode step}; linear in between and beyond
    decode_s_per_ctx_token  and per token of context of each decoding request (attention reading its KV;
                            optional, default 0: the table's own context)
    max_batched_tokens      chunked-prefill budget of one step (decode tokens count too)
    max_num_seqs            requests an engine runs at once
    engine_kv_gib           an engine's local KV cache
    engines_per_server      engines sharing one kvstore-server (a node)
    server_gib              each kvstore-server's memory tier
    tiers.server / .valkey  load_gbps (one transfer), aggregate_gbps (the tier's total)
    network                 hop_latency_s, nic_gbps (an engine's link); 0 or null bandwidth = unlimited

A GB/s here is 1e9 bytes per second.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgument

PROFILES = Path(__file__).parent / "profiles"


def _value(doc: dict[str, Any], *path: str) -> Any:
    node: Any = doc
    for p in path:
        if not isinstance(node, dict) or p not in node:
            raise InvalidArgument(f"profile {doc.get('name', '?')!r}: missing {'.'.join(path)}")
        node = node[p]
    return node["value"] if isinstance(node, dict) and "value" in node else node


def _bandwidth(v: Any) -> float:
    """Bytes/s from GB/s; 0 or None is unlimited."""
    return math.inf if not v else float(v) * 1e9


@dataclass(frozen=True)
class Profile:
    name: str
    kv_bytes_per_token: int
    prefill_s_per_token: float
    prefill_step_s: float
    prefill_s_per_token_ctx: float
    decode_batches: tuple[int, ...]
    decode_seconds: tuple[float, ...]
    max_batched_tokens: int
    max_num_seqs: int
    engine_kv_gib: float
    engines_per_server: int
    server_gib: float
    server_load_bps: float
    server_aggregate_bps: float
    valkey_load_bps: float
    valkey_aggregate_bps: float
    hop_latency_s: float
    nic_bps: float
    save_s_per_token: float = 0.0
    decode_s_per_ctx_token: float = 0.0

    def scaled(self, factor: float) -> Profile:
        """The same engine on a machine `factor` times slower: every compute cost times `factor`."""
        assert factor > 0, factor
        return dataclasses.replace(
            self,
            prefill_s_per_token=self.prefill_s_per_token * factor,
            prefill_step_s=self.prefill_step_s * factor,
            prefill_s_per_token_ctx=self.prefill_s_per_token_ctx * factor,
            decode_seconds=tuple(s * factor for s in self.decode_seconds),
            decode_s_per_ctx_token=self.decode_s_per_ctx_token * factor,
            save_s_per_token=self.save_s_per_token * factor,
        )

    def decode_s(self, batch: int, context: int) -> float:
        """Seconds of one decode step of `batch` requests with `context` tokens before their new ones
        in all."""
        return self.decode_step_s(batch) + self.decode_s_per_ctx_token * context if batch > 0 else 0.0

    def decode_step_s(self, batch: int) -> float:
        """Seconds of one decode step of `batch` requests: the measured table, linear between its
        points and along its last segment beyond them; 0 for an empty batch."""
        if batch <= 0:
            return 0.0
        xs, ys = self.decode_batches, self.decode_seconds
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_left(xs, batch), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (batch - x0) / (x1 - x0), 0.0)

    def prefill_s(self, tokens: int, start: int = 0) -> float:
        """Compute of prompt tokens [start, start + tokens): each costs prefill_s_per_token plus
        prefill_s_per_token_ctx per token before it."""
        return tokens * (self.prefill_s_per_token + self.prefill_s_per_token_ctx * (start + (tokens - 1) / 2))

    def chunk_bytes(self, tokens: int = 256) -> int:
        return self.kv_bytes_per_token * tokens

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Profile:
        decode = {int(b): float(s) for b, s in _value(doc, "decode_step_s").items()}
        if not decode or min(decode) < 1 or any(s < 0 for s in decode.values()):
            raise InvalidArgument("decode_step_s needs batch sizes >= 1 mapped to seconds >= 0")
        batches = tuple(sorted(decode))
        p = cls(
            name=str(doc.get("name", "?")),
            kv_bytes_per_token=int(_value(doc, "kv_bytes_per_token")),
            prefill_s_per_token=float(_value(doc, "prefill_s_per_token")),
            prefill_step_s=float(_value(doc, "prefill_step_s")),
            prefill_s_per_token_ctx=float(
                _value(doc, "prefill_s_per_token_ctx") if "prefill_s_per_token_ctx" in doc else 0.0
            ),
            decode_batches=batches,
            decode_seconds=tuple(decode[b] for b in batches),
            max_batched_tokens=int(_value(doc, "max_batched_tokens")),
            max_num_seqs=int(_value(doc, "max_num_seqs")),
            engine_kv_gib=float(_value(doc, "engine_kv_gib")),
            engines_per_server=int(_value(doc, "engines_per_server")),
            server_gib=float(_value(doc, "server_gib")),
            server_load_bps=_bandwidth(_value(doc, "tiers", "server", "load_gbps")),
            server_aggregate_bps=_bandwidth(_value(doc, "tiers", "server", "aggregate_gbps")),
            valkey_load_bps=_bandwidth(_value(doc, "tiers", "valkey", "load_gbps")),
            valkey_aggregate_bps=_bandwidth(_value(doc, "tiers", "valkey", "aggregate_gbps")),
            hop_latency_s=float(_value(doc, "network", "hop_latency_s")),
            nic_bps=_bandwidth(_value(doc, "network", "nic_gbps")),
            save_s_per_token=float(_value(doc, "save_s_per_token") if "save_s_per_token" in doc else 0.0),
            decode_s_per_ctx_token=float(
                _value(doc, "decode_s_per_ctx_token") if "decode_s_per_ctx_token" in doc else 0.0
            ),
        )
        if p.kv_bytes_per_token <= 0 or p.max_batched_tokens <= 0 or p.max_num_seqs <= 0:
            raise InvalidArgument(f"profile {p.name!r}: sizes must be positive")
        if min(p.prefill_s_per_token, p.prefill_step_s, p.prefill_s_per_token_ctx, p.hop_latency_s,
               p.save_s_per_token, p.decode_s_per_ctx_token) < 0:  # fmt: skip
            raise InvalidArgument(f"profile {p.name!r}: costs must be >= 0")
        return p


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (profiles/<name>.json) or by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES / f"{name_or_path}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json")))
        raise InvalidArgument(f"no profile {name_or_path!r} (known: {known})")
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise InvalidArgument(f"{path}: not JSON ({e})") from None
    return Profile.from_dict(doc)
