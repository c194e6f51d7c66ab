"""The redis tier: blobs in Redis or Valkey, standalone or Cluster (docs/design.md §4, §10, §11).

`RedisTier` (tier.py) is the Tier; the rest of the package is how it gets there: `connection.py`
(URLs, zero-copy connections), `servers.py` (routing, Cluster redirects, a circuit breaker per
server), `commands.py` (pipelines, values, TTLs, INFO) and `index.py` (byte accounting); the invalidations an
outage leaves are kvstore/tiers/handoff/'s, replayed when the servers answer.
"""

from kvstore.tiers.redis.tier import RedisTier

__all__ = ["RedisTier"]
