"""One hung holder costs only its blocks: a per-holder time box.

A transfer past its deadline used to open the pool's breaker: every lookup of every
instance then answered "miss" for seconds, although only one holder had stopped
answering (a SIGSTOPped or swapping holder; the master and the other holders fine).
:class:`HolderGuard` tells the two apart. When a transfer stalls it asks the master
where the blocks live (``batch_get_replica_desc``, on the control box) — no answer:
the pool is away, the breaker opens as before — and probes each of those holders with
a small real read (its own box, 1 s); one that does not answer is *suspended*: loads
stop before its first block (a miss, ``holder_suspended``, vLLM recomputes) while every
other holder keeps serving, until a probe finds it answering again (every
``cooldown`` s, on the next load that would need it). A put that stalls while the
master answers skips saves for ``cooldown`` s instead of opening the breaker (the
master may place the next put on the same holder). Each change is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mooncake_vllm.errors import CallRejected, CallTimedOut
from mooncake_vllm.stats import StoreStats
from mooncake_vllm.store.timebox import TimeBox

__all__ = ["HolderGuard", "TimedCalls"]


class TimedCalls(Protocol):
    """What the guard needs of its transport (:class:`~mooncake_vllm.store.transport.Transport`,
    which owns the guard: a protocol here keeps the import one way)."""

    control: TimeBox
    stats: StoreStats

    @property
    def store(self) -> Any: ...

    def run(self, box: TimeBox, timeout: float, fn: Callable[..., Any], *args: Any,
            breaker: bool = True) -> Any: ...

log = logging.getLogger(__name__)


def _endpoint(replicas: Any) -> str | None:
    try:
        return str(replicas[0].get_memory_descriptor().buffer_descriptor.transport_endpoint)
    except Exception:  # noqa: BLE001 - no replica, a disk replica, an older binding
        return None


def _dropped(transport: TimedCalls, where: str) -> None:
    transport.stats.add("holders_dropped")  # the V1 scheduler re-saves from HBM (v1/pool_loss)
    log.warning("mooncake-vllm: the master no longer lists the blocks of pool holder %s: it "
                "stalled longer than the master's --client_ttl, which unmounted its segment and "
                "dropped its blocks (or they were evicted); they are misses until saved again. "
                "Keep --client_ttl above the longest stall a holder may have", where)


class HolderGuard:
    """Suspended holders (by transfer endpoint) of one transport, and their probes."""

    def __init__(self, transport: TimedCalls, *, cooldown: float = 3.0, probe_timeout: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._t = transport
        self.cooldown = cooldown
        self.probe_timeout = probe_timeout
        self._clock = clock
        #: probes of several holders at once; a hung probe keeps its worker until it returns
        self.box = TimeBox("holder-probe", 4)
        self._lock = threading.Lock()
        self.suspended: dict[str, tuple[float, str]] = {}  #: endpoint -> (next probe at, a key it holds)

    def _where(self, keys: Sequence[str]) -> list[str | None] | None:
        """Each key's holder (transfer endpoint); ``None`` when the master did not answer."""
        store = self._t.store
        if hasattr(store, "batch_get_replica_desc"):
            got = self._t.run(self._t.control, self.probe_timeout, store.batch_get_replica_desc,
                              list(keys), breaker=False)
            if isinstance(got, BaseException) or not isinstance(got, dict):
                return None
            return [_endpoint(got.get(k)) for k in keys]
        if hasattr(store, "get_replica_desc"):
            out: list[str | None] = []
            for key in keys:
                got = self._t.run(self._t.control, self.probe_timeout, store.get_replica_desc, key,
                                  breaker=False)
                if isinstance(got, BaseException):
                    return None
                out.append(_endpoint(got))
            return out
        return None

    def _probe(self, key: str) -> str:
        """A small real read from the holder of ``key`` within the probe timeout: ``answers``,
        ``silent``, or ``gone`` (an empty read while the master no longer lists the key: it
        proves nothing about the holder, and there is nothing left there to wait for)."""
        try:
            got = self.box.run(self.probe_timeout, self._t.store.get, key)
        except (CallTimedOut, CallRejected):
            return "silent"
        if isinstance(got, BaseException):
            return "silent"
        if got:
            return "answers"
        listed = self._t.run(self._t.control, self.probe_timeout, self._t.store.is_exist, key,
                             breaker=False)
        return "silent" if isinstance(listed, int) and listed == 1 else "gone"

    def stalled(self, keys: Sequence[str]) -> bool:
        """A load of ``keys`` passed its deadline. True when the master answers (then it was
        no pool outage: the holders that do not answer a probe are suspended), False when
        the master does not (the caller opens the breaker)."""
        places = self._where(keys)
        if places is None:
            return False
        first: dict[str, str] = {}
        for key, where in zip(keys, places):
            if where is not None:
                first.setdefault(where, key)
        for where, key in first.items():
            if where in self.suspended:
                continue
            state = self._probe(key)
            if state == "gone":
                _dropped(self._t, where)
            if state != "silent":
                continue
            with self._lock:
                self.suspended[where] = (self._clock() + self.cooldown, key)
            self._t.stats.add("holders_suspended")
            log.warning("mooncake-vllm: pool holder %s does not answer (a transfer passed its "
                        "deadline; the master answers): its blocks are misses until it answers "
                        "again; the other holders keep serving. Check that holder's process and "
                        "link", where)
        return True

    def master_answers(self) -> bool:
        """Whether the master answers an existence query within the probe timeout."""
        rc = self._t.run(self._t.control, self.probe_timeout, self._t.store.is_exist, "mcv/probe",
                         breaker=False)
        return not isinstance(rc, BaseException) and rc >= 0

    def usable(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` may be loaded: all, or up to the first block of a
        suspended holder (probing those due first)."""
        if not self.suspended:
            return len(keys)
        self._reprobe()
        if not self.suspended:
            return len(keys)
        places = self._where(keys)
        if places is None:
            return len(keys)  # the master is away: the load's own calls find out
        return next((i for i, where in enumerate(places) if where in self.suspended), len(keys))

    def _reprobe(self) -> None:
        now = self._clock()
        for where, (due, key) in list(self.suspended.items()):
            if due > now:
                continue
            state = self._probe(key)
            if state != "silent":
                with self._lock:
                    self.suspended.pop(where, None)
                if state == "answers":
                    log.warning("mooncake-vllm: pool holder %s answers again", where)
                else:
                    _dropped(self._t, where)
            else:
                with self._lock:
                    self.suspended[where] = (self._clock() + self.cooldown, key)

    def close(self) -> None:
        self.box.close()
