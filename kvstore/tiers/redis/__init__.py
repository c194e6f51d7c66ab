"""The redis tier: blobs in Redis or Valkey, standalone or Cluster (docs/design.md §4, §10, §11).

`RedisTier` (tier.py) is the Tier; the rest of the package is how it gets there: `connection.py`
(URLs, zero-copy connections), `servers.py` (routing, Cluster redirects, a circuit breaker per
server), `commands.py` (pipelines, values, TTLs, INFO), `index.py` (byte accounting) and `handoff.py`
(the invalidations an outage leaves, replayed when the servers answer).
"""

from kvstore.tiers.redis.tier import RedisTier, handoff_dir

__all__ = ["RedisTier", "handoff_dir"]
