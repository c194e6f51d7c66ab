"""benchmarks/fleet.py: `up` starts a 3+3 Cluster and two servers sharing it (a blob put through one
is a hit through the other), prints their URLs; `down` stops every process it started."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kvstore.sdk.remote import RemoteBackend

from tests.connectors.conftest import ROOT
from tests.fleet.test_fleet import blob
from tests.valkey import valkey_env_ok, wait_until

pytestmark = pytest.mark.skipif(not valkey_env_ok(), reason="no valkey-server")


def fleet(home: Path, *args: str) -> str:
    env = {**os.environ, "HOME": str(home)}
    out = subprocess.run([sys.executable, "benchmarks/fleet.py", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_prints_urls_and_down_stops_everything(tmp_path: Path) -> None:
    printed = fleet(tmp_path, "up", "--servers", "2")
    pids = json.loads((tmp_path / ".cache/kvstore/fleet/fleet.json").read_text())["pids"]
    try:
        assert len(pids) == 8  # 6 valkey-servers, 2 kvstore-servers
        assert "3 primaries + 3 replicas" in printed
        urls = re.findall(r"kvstore-server \d: (http://\S+)", printed)
        assert len(urls) == 2
        one, two = (RemoteBackend(u, read_index=False) for u in urls)
        k = uuid.uuid4().hex
        b = blob(7, key=k)  # bound to its key: served as it is
        assert "redis" in one.put_blob(k, b)
        assert bytes(two.get_blob(k)) == b
        one.close()
        two.close()
        assert urls[1] in fleet(tmp_path, "status")
    finally:
        assert "stopped 8 processes" in fleet(tmp_path, "down")
    wait_until(lambda: all(gone(p) for p in pids), timeout=15)
    assert "no fleet recorded" in fleet(tmp_path, "down")
