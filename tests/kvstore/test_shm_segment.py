"""A shared-memory segment's close: its fd is closed even while a view of it is still alive (a
BufferError there had skipped the os.close and said nothing), and that is logged."""

from __future__ import annotations

import logging
import os
import pickle

import numpy as np
import pytest

from kvstore.protocol import shm
from kvstore.tiers.arena_index import ArenaIndex

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc")


def fd_is_the_segment(fd: int) -> bool:
    try:
        return "kvstore-shm" in os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False


def test_a_closed_segment_closes_its_fd_even_while_viewed(caplog) -> None:
    seg = shm.Segment(7, shm.DATA_START + 4096)
    held = pickle.PickleBuffer(seg.view)  # holds a buffer of the segment's own view (an export of it)
    viewed = np.frombuffer(seg.map, np.uint8)  # and one of the mapping
    assert fd_is_the_segment(seg.fd)
    with caplog.at_level(logging.WARNING, logger="kvstore.protocol.shm"):
        seg.close()
    assert not fd_is_the_segment(seg.fd)
    assert "segment 7 closed while still viewed" in caplog.text
    assert viewed[: len(shm.MAGIC)].tobytes() == shm.MAGIC and held.raw()[:1] == shm.MAGIC[:1]  # still mapped
    del held, viewed


def test_a_segment_closed_unviewed_says_nothing(caplog) -> None:
    seg = shm.Segment(8, shm.DATA_START + 4096)
    with caplog.at_level(logging.WARNING, logger="kvstore.protocol.shm"):
        seg.close()
    assert not fd_is_the_segment(seg.fd) and caplog.text == ""


def test_an_arena_index_closed_while_viewed_closes_its_fd(caplog) -> None:
    index = ArenaIndex(1 << 20)
    held = pickle.PickleBuffer(index.segment.view)
    with caplog.at_level(logging.WARNING, logger="kvstore.protocol.shm"):
        index.close()
    assert not fd_is_the_segment(index.segment.fd) and "closed while still viewed" in caplog.text
    del held
