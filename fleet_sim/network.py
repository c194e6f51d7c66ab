"""Links with a bandwidth, shared first come first served: a transfer holds every link it crosses for
its bytes over that link's bandwidth, starting when all of them are free (the bottleneck sets the pace,
a busy link delays whoever comes next)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Link:
    name: str
    bytes_per_s: float = math.inf
    free_at: float = 0.0
    bytes: int = 0  # carried so far

    def time_for(self, nbytes: int) -> float:
        return 0.0 if math.isinf(self.bytes_per_s) else nbytes / self.bytes_per_s


def transfer(
    now: float, nbytes: int, links: Sequence[Link], per_stream_bps: float, latency_s: float
) -> float:
    """When `nbytes` sent at `now` over `links` (one stream of at most `per_stream_bps`) have arrived."""
    if nbytes <= 0:
        return now
    start = max([now, *(link.free_at for link in links)])
    stream = 0.0 if math.isinf(per_stream_bps) else nbytes / per_stream_bps
    end = start
    for link in links:
        link.free_at = start + link.time_for(nbytes)
        link.bytes += nbytes
        end = max(end, link.free_at)
    return max(end, start + stream) + latency_s
