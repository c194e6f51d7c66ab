"""benchmarks/fleet_netns.py: `fleet.py up --netns` puts each machine in a namespace of its own on one
bridge, reachable at the address it was given, and removes exactly what it made."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fleet_netns import Netns, available  # noqa: E402

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no network namespaces: {available()}")


def _names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_machines_reach_each_other_and_everything_is_removed() -> None:
    net = Netns()
    net.make(["a", "b"])
    try:
        assert net.address("a") != net.address("b") and net.address("a").startswith("10.213.")
        port = 47123  # a fresh namespace: every port is free
        serve = subprocess.Popen(
            [
                *net.launcher("a"),
                sys.executable,
                "-c",
                f"import socket; s = socket.create_server(('{net.address('a')}', {port})); "
                "c, _ = s.accept(); c.sendall(b'hi'); c.close()",
            ]  # fmt: skip
        )
        code = (
            f"import socket, time\nfor _ in range(100):\n    try:\n"
            f"        print(socket.create_connection(('{net.address('a')}', {port}), 1).recv(2).decode()); break\n"
            "    except OSError:\n        time.sleep(0.05)\n"
        )
        out = subprocess.run(
            [*net.launcher("b"), sys.executable, "-c", code], capture_output=True, text=True, timeout=30
        )
        serve.wait(timeout=30)
        assert out.stdout.strip() == "hi", out.stderr
        assert f"kvf{net.tag}-a" in _names()
    finally:
        left = net.remove()
    assert left == [] and f"kvf{net.tag}-" not in _names()
    assert subprocess.run(["ip", "link", "show", net.bridge], capture_output=True).returncode != 0
