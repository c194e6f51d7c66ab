"""The fs tier: one directory several kvstore-servers share (NFS, Lustre): `FsTier` (tier.py), its
files (files.py) and sweeps (sweep.py). docs/design.md §4."""

from kvstore.tiers.fs.tier import FsTier

__all__ = ["FsTier"]
