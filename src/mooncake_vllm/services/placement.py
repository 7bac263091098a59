"""Where a service runs: its address and, for a simulated host, its network namespace.

A :class:`Placement` is what the launchers take instead of hard-coding loopback: the
address a service binds and is reached at, and the Linux network namespace (made by
the caller, e.g. ``bench/soak_net.py``) its process runs in, through
``ip netns exec`` (which execs in place: the PID we signal is the service's own).
The default, :data:`LOOPBACK`, is 127.0.0.1 in this process's namespace.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from mooncake_vllm.errors import ServiceError

__all__ = ["LOOPBACK", "Placement"]


@dataclass(frozen=True)
class Placement:
    """``host``: the address a service binds and is reached at; ``netns``: the network
    namespace it runs in (``None``: this process's own)."""

    host: str = "127.0.0.1"
    netns: str | None = None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside :attr:`netns` (unchanged without one)."""
        if self.netns is None:
            return [str(a) for a in argv]
        ip = shutil.which("ip")
        if ip is None:
            raise ServiceError(f"placement in network namespace {self.netns!r}: the `ip` command "
                               "(iproute2) is not installed; install it or run on loopback")
        return [ip, "netns", "exec", self.netns, *map(str, argv)]

    def __str__(self) -> str:
        return self.host if self.netns is None else f"{self.host} (netns {self.netns})"


#: 127.0.0.1 in this process's own network namespace
LOOPBACK = Placement()
