"""Simulated hosts for the soak: network namespaces on one bridge, veth links, tc shaping.

Each host is a namespace ``<prefix>-<name>`` with one veth link (``eth0`` inside) to a
bridge in the root namespace that also carries ``<subnet>.1``, so the hosts reach each
other and the driver (this process) reaches every one of them over real, non-loopback
addresses. ``netem`` is not in this kernel: faults are a link set down (``link_down``)
and a bandwidth cap (``tc tbf`` on both ends of a link, ``shape``). Everything made
here is named with the prefix and removed by :meth:`Net.teardown` (also leftovers of a
previous run, by :meth:`Net.sweep`).
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass, field

from mooncake_vllm.services import Placement

__all__ = ["Net", "NetError", "namespaces_available"]

log = logging.getLogger(__name__)


class NetError(RuntimeError):
    """An ``ip``/``tc`` command failed (the message names the command and its output)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)  # noqa: S603
    if check and proc.returncode != 0:
        raise NetError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces_available() -> str | None:
    """``None`` when network namespaces, veth and a bridge can be made here, else why not."""
    probe = "mvsoak-probe"
    try:
        _run("ip", "netns", "add", probe)
    except (NetError, OSError) as exc:
        return str(exc)
    try:
        _run("ip", "link", "add", "mvsoak-pa", "type", "veth", "peer", "name", "mvsoak-pb")
        _run("ip", "link", "del", "mvsoak-pa")
    except NetError as exc:
        return str(exc)
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Net:
    """The namespaces, links and bridge of one soak (prefix and /24 subnet are the caller's)."""

    prefix: str = "mvsoak"
    subnet: str = "10.231.7"
    hosts: dict[str, Placement] = field(default_factory=dict)
    _next: int = 10

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def gateway(self) -> str:
        """The driver's own address on the bridge."""
        return f"{self.subnet}.1"

    def _veth(self, name: str) -> str:
        return f"{self.prefix[:4]}-{name}"[:15]  # root side; interface names <= 15 bytes

    def up(self) -> Net:
        """Make the bridge (sweeping leftovers of an earlier run first)."""
        self.sweep()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        return self

    def add_host(self, name: str) -> Placement:
        """A namespace with one link to the bridge; returns where services there run."""
        ns, veth, addr = f"{self.prefix}-{name}", self._veth(name), f"{self.subnet}.{self._next}"
        self._next += 1
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}-i"[:15])
        _run("ip", "link", "set", f"{veth}-i"[:15], "netns", ns, "name", "eth0")
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        for cmd in (("addr", "add", f"{addr}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                    ("link", "set", "lo", "up"), ("route", "add", "default", "via", self.gateway)):
            _run("ip", "-n", ns, *cmd)
        self.hosts[name] = Placement(addr, ns)
        return self.hosts[name]

    def link_down(self, name: str) -> None:
        """Cut ``name``'s link (both ends: nothing goes in or out)."""
        _run("ip", "link", "set", self._veth(name), "down")

    def link_up(self, name: str) -> None:
        _run("ip", "link", "set", self._veth(name), "up", "master", self.bridge)

    def shape(self, name: str, rate: str | None, burst: str = "256kb", latency: str = "50ms") -> None:
        """Cap ``name``'s link to ``rate`` (e.g. ``"20mbit"``) both ways with ``tc tbf``;
        ``None`` removes the cap."""
        ns = self.hosts[name].netns
        ends = ((), self._veth(name)), (("ip", "netns", "exec", str(ns)), "eth0")
        for prefix, dev in ends:
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate is not None:
                _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", burst, "latency", latency)

    def sweep(self) -> None:
        """Remove every namespace, link and bridge carrying this prefix (ours, from any run)."""
        listing = _run("ip", "netns", "list", check=False).stdout.split("\n")
        for line in listing:
            ns = line.split(" ")[0]
            if ns.startswith(self.prefix + "-"):
                _run("ip", "netns", "del", ns, check=False)
        links = _run("ip", "-o", "link", "show", check=False).stdout.splitlines()
        for line in links:
            dev = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if dev == self.bridge or dev.startswith(self.prefix[:4] + "-"):
                _run("ip", "link", "del", dev, check=False)

    def teardown(self) -> None:
        self.sweep()
        self.hosts.clear()
