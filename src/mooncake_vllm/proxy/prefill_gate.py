"""One streamed prefill at a time per instance: a request waits in the proxy (bounded) until the
prefill ahead of it on its instance has sent its first token.

Why (issue 29): on a closed loop of multi-turn conversations, the turns of conversations homed on
one instance fall into step — batched in one step, they finish decoding in the same step, and
their next turns arrive together and prefill together again, each paying for all of them.
Entering one step after the first token ahead shifts a turn by one decode step once; from then on
its next turns arrive while the others decode, not while they prefill. Only streamed requests
take part (a whole answer shows no first token to wait for).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

__all__ = ["GateTicket", "PrefillGate"]

log = logging.getLogger(__name__)


class GateTicket:
    """A request's place at its instance's gate; :meth:`release` (idempotent) lets the next in."""

    __slots__ = ("_lock",)

    def __init__(self, lock: asyncio.Lock | None) -> None:
        self._lock = lock

    def release(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.release()


class PrefillGate:
    """Per instance a lock held from a streamed request's send to its first byte; a request waits
    for it at most ``max_wait`` seconds (then goes anyway, holding nothing)."""

    def __init__(self, max_wait: float) -> None:
        if max_wait <= 0:
            raise ValueError(f"max_wait must be > 0 s, got {max_wait!r}")
        self.max_wait = max_wait
        self._locks: dict[str, asyncio.Lock] = {}
        self.counts: Counter[str] = Counter()  # outcome -> requests: free, waited, timed_out
        self.waited_s = 0.0

    async def enter(self, key: str) -> GateTicket:
        """Wait (bounded) until no streamed prefill is ahead on instance ``key``."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        if not lock.locked():
            await lock.acquire()
            self.counts["free"] += 1
            return GateTicket(lock)
        t0 = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(self.max_wait):
                await lock.acquire()
        except TimeoutError:
            self.counts["timed_out"] += 1
            self.waited_s += asyncio.get_running_loop().time() - t0
            return GateTicket(None)
        self.counts["waited"] += 1
        self.waited_s += asyncio.get_running_loop().time() - t0
        return GateTicket(lock)

    def render(self) -> str:
        """The gate's counters in Prometheus text."""
        name = "mooncake_proxy_prefill_gate"
        return "".join([
            f"# HELP {name}_total streamed requests at the prefill gate, by outcome\n# TYPE {name}_total counter\n",
            *(f'{name}_total{{outcome="{k}"}} {self.counts[k]}\n' for k in ("free", "waited", "timed_out")),
            f"# HELP {name}_wait_seconds_total time requests waited at the gate\n"
            f"# TYPE {name}_wait_seconds_total counter\n{name}_wait_seconds_total {self.waited_s:.6f}\n"])
