"""Network namespaces for benchmarks/fleet.py (`up --netns`): each "machine" of the fleet (the Valkey
Cluster, each kvstore-server, each engine) in a namespace of its own, joined by a veth pair to one
bridge in this namespace, with an optional `tc netem` delay on each machine's link.

Only addresses this script assigns itself: 10.213.<subnet>.0/24, a subnet no interface here uses yet;
the bridge is .1, machine k is .k+2. Names carry one random tag (`kvf<tag>...`), so `remove` deletes
exactly what `make` created (deleting a namespace deletes its end of the veth pair, and the other end
with it). Where namespaces cannot be made (not root, no `ip`) `available()` says why; where the
kernel has no netem (`tc` answers "unknown qdisc") the links carry no delay and `make` says so.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

NET = "10.213"


class NetnsError(RuntimeError):
    """A namespace, link or address could not be made."""


def available() -> str | None:
    """None where namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on PATH"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def _free_subnet() -> int:
    used = _ip("-o", "-4", "addr", "show")
    for subnet in range(1, 255):
        if f" {NET}.{subnet}." not in used:
            return subnet
    raise NetnsError(f"every {NET}.x.0/24 subnet is in use")


@dataclass
class Netns:
    """The namespaces of one fleet. `machines`: name -> (namespace, address)."""

    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: int = 0
    delay_ms: float = 0.0
    machines: dict[str, tuple[str, str]] = field(default_factory=dict)
    delay_note: str = ""

    @property
    def bridge(self) -> str:
        return f"kvf{self.tag}br"

    @property
    def gateway(self) -> str:
        return f"{NET}.{self.subnet}.1"

    def make(self, names: list[str], delay_ms: float = 0.0) -> None:
        """The bridge and one namespace per name. On failure, whatever was made is removed."""
        self.delay_ms = delay_ms
        try:
            self.subnet = _free_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for k, name in enumerate(names):
                self._machine(k, name)
        except BaseException:
            self.remove()
            raise

    def _machine(self, k: int, name: str) -> None:
        ns, host_end, addr = f"kvf{self.tag}-{name}", f"kvf{self.tag}v{k}", f"{NET}.{self.subnet}.{k + 2}"
        _ip("netns", "add", ns)
        self.machines[name] = (ns, addr)  # recorded at once: `remove` deletes it from here on
        _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", host_end, "master", self.bridge)
        _ip("link", "set", host_end, "up")
        for args in (("link", "set", "lo", "up"), ("addr", "add", f"{addr}/24", "dev", "eth0"),
                     ("link", "set", "eth0", "up")):  # fmt: skip
            _ip("-n", ns, *args)
        if self.delay_ms > 0:
            self._delay(ns)

    def _delay(self, ns: str) -> None:
        cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay"]
        out = subprocess.run([*cmd, f"{self.delay_ms}ms"], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            self.delay_note = f"no netem delay: `tc ... netem` failed here ({out.stderr.strip()})"

    def launcher(self, name: str) -> list[str]:
        """The command prefix that runs a program in machine `name`'s namespace."""
        return ["ip", "netns", "exec", self.machines[name][0]]

    def address(self, name: str) -> str:
        return self.machines[name][1]

    def remove(self) -> list[str]:
        """Delete every namespace and the bridge this fleet made; returns what could not be deleted."""
        left = []
        for ns, _ in self.machines.values():
            out = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=10)
            if out.returncode != 0 and "No such file" not in out.stderr:
                left.append(ns)
        out = subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, text=True, timeout=10)
        if out.returncode != 0 and "Cannot find device" not in out.stderr:
            left.append(self.bridge)
        return left

    def as_dict(self) -> dict:
        return {"tag": self.tag, "subnet": self.subnet, "delay_ms": self.delay_ms,
                "machines": self.machines, "delay_note": self.delay_note}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Netns:
        machines = {k: (v[0], v[1]) for k, v in d["machines"].items()}
        return cls(d["tag"], d["subnet"], d["delay_ms"], machines, d.get("delay_note", ""))
