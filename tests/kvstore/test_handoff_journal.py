"""The redis tier's invalidation journal on a real file system: records replayed on open, a torn last
record ignored, the slots of processes that are gone merged (a live process's left alone), the log
compacted and removed once nothing waits."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.tiers.handoff import journal as handoff_journal
from kvstore.tiers.handoff.invalidations import Invalidations
from kvstore.tiers.handoff.journal import Journal


def test_keys_survive_a_reopen_and_a_torn_record_is_ignored(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.load()
    j.append(added=["a", "b", "c"], live=3)
    j.append(removed=["b"], live=2)
    with j.path.open("ab") as f:
        f.write(b"+torn")  # a crash in the middle of an append
    j.close(waiting=2)
    again = Journal(tmp_path)
    assert again.load() == ["a", "c"]
    again.close(waiting=2)


def test_dead_processes_slots_are_merged_and_a_live_one_is_not(tmp_path: Path) -> None:
    live = Journal(tmp_path)
    live.load()
    live.append(added=["live"], live=1)
    dead = [Journal(tmp_path), Journal(tmp_path)]  # the next slots
    for n, j in enumerate(dead):
        j.load()
        j.append(added=[f"dead{n}"], live=1)
    for j in dead:
        j.close(waiting=1)  # their processes stopped with a key waiting
    third = Journal(tmp_path)  # takes the first free slot and merges the other dead one into it
    assert third.path == dead[0].path
    assert sorted(third.load()) == ["dead0", "dead1"]
    assert not dead[1].path.exists()
    third.close(waiting=2)
    live.close(waiting=1)
    last = Journal(tmp_path)  # every process gone: one slot gets everything
    assert sorted(last.load()) == ["dead0", "dead1", "live"]
    last.close(waiting=3)


def test_invalidations_compact_and_clean_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff_journal, "COMPACT_SLACK", 16)  # (4096 in use: fewer fsyncs here)
    inv = Invalidations(10, Journal(tmp_path))
    for i in range(100):  # far more records than waiting keys: rewritten
        assert inv.add([f"k{i % 3}", "stays"]) == []
        inv.discard(f"k{i % 3}")
    assert len(inv) == 1
    journal = inv._journal
    assert journal is not None
    assert journal.path.read_bytes().count(b"\n") <= 16 + 2 * 2 + 2
    inv.close_journal()
    again = Invalidations(10, Journal(tmp_path))
    assert "stays" in again and len(again) == 1
    again.discard("stays")
    assert again._journal is not None and again._journal.path.stat().st_size == 0  # emptied
    again.close_journal()
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # removed: nothing waits


def test_a_state_directory_that_cannot_be_used_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="state_dir"):
        Journal("/proc/kvstore-handoff")  # (procfs: no directory can be made there)


def test_a_garbled_record_is_dropped_and_the_ones_after_it_kept(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.load()
    j.append(added=["a"], live=1)
    with j.path.open("ab") as f:
        f.write(b"+b 00000000\n")  # a record whose checksum does not hold: never acknowledged
    j._size = j.path.stat().st_size
    j.append(added=["c"], live=2)
    j.close(waiting=2)
    again = Journal(tmp_path)
    assert again.load() == ["a", "c"]
    assert again.path.read_bytes().startswith(handoff_journal.HEADER)
    again.close(waiting=2)


def test_the_older_format_is_read_and_rewritten(tmp_path: Path) -> None:
    (tmp_path / "0.log").write_bytes(b"+a\n+b\n-a\n+torn")  # before checksums: lines, a torn tail
    j = Journal(tmp_path)
    assert j.load() == ["b"]
    data = j.path.read_bytes()
    assert data.startswith(handoff_journal.HEADER) and data.count(b"\n") == 2
    j.close(waiting=1)
