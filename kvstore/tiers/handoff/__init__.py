"""Hinted handoff (docs/design.md §10), for every tier that declares it (kvstore.tier_registry): the
keys a delete or replace could not reach the backend with (`Invalidations`), the thread that deletes
them once it answers (`Handoff`, replayer.py), and their journal, so a restart keeps them (`Journal`)."""

from kvstore.tiers.handoff.invalidations import Invalidations
from kvstore.tiers.handoff.journal import Journal
from kvstore.tiers.handoff.replayer import REPLAY_BATCH, REPLAY_INTERVAL_S, Handoff

__all__ = ["Handoff", "Invalidations", "Journal", "REPLAY_BATCH", "REPLAY_INTERVAL_S"]
