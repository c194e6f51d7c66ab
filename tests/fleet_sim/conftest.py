"""Fixtures of the fleet simulator's tests: the public traces and a profile where nothing takes time."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvstore.fleet_sim.profile import Profile

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
CONVERSATION = TRACES / "mooncake_conversation_trace.jsonl"
SYNTHETIC = TRACES / "mooncake_synthetic_trace.jsonl"


def profile_doc(**over) -> dict:
    """A profile document; every cost 0 unless given."""
    doc = {
        "name": "test",
        "kv_bytes_per_token": 1024,
        "prefill_s_per_token": 0.0,
        "prefill_step_s": 0.0,
        "decode_step_s": {"1": 0.0},
        "max_batched_tokens": 1024,
        "max_num_seqs": 64,
        "engine_kv_gib": 1,
        "engines_per_server": 8,
        "server_gib": 0,
        "tiers": {
            "server": {"load_gbps": 0, "aggregate_gbps": 0},
            "valkey": {"load_gbps": 0, "aggregate_gbps": 0},
        },
        "network": {"hop_latency_s": 0.0, "nic_gbps": 0},
    }
    doc.update(over)
    return doc


@pytest.fixture
def zero_profile() -> Profile:
    return Profile.from_dict(profile_doc(name="zero"))


@pytest.fixture(scope="session")
def traces() -> tuple[Path, Path]:
    if not CONVERSATION.exists() or not SYNTHETIC.exists():
        pytest.fail(f"the Mooncake traces are not in {TRACES}")
    return CONVERSATION, SYNTHETIC
