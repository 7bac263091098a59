"""The soak's fault schedule: which fault, when, for how long; run against a :class:`Fleet`.

Each kind is a ``begin`` and an ``end`` (the end also repairs: restart what was killed,
resume what was stopped, bring the link up). The schedule is printed at start; the
runner records when each fault really began and ended, for the per-fault report.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "SETTLE", "Fault", "FaultRunner", "schedule"]

#: the last fault is scheduled to end this long before the load stops (its recovery is measured)
SETTLE = 20.0

log = logging.getLogger("soak.faults")

Action = Callable[[Any], None]  # takes the fleet


@dataclass(frozen=True)
class Kind:
    """One fault: what it does, for how long (s), and what ends it."""

    name: str
    what: str
    duration: float
    begin: Action
    end: Action


def _rolling(fleet: Any) -> None:
    fleet.rolling_restart()


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("holder_kill", "SIGKILL holder h1, restart it after 3 s", 3.0,
         lambda f: f.kill("h1"), lambda f: f.start("h1")),
    Kind("holder_stop", "SIGSTOP holder h1 for 10 s (a hung peer)", 10.0,
         lambda f: f.pause("h1"), lambda f: f.resume("h1")),
    Kind("master_kill", "SIGKILL the master, restart it (same ports) after 2 s", 2.0,
         lambda f: f.kill("master"), lambda f: f.start("master")),
    Kind("master_stop", "SIGSTOP the master for 5 s", 5.0,
         lambda f: f.pause("master"), lambda f: f.resume("master")),
    Kind("metadata_restart", "restart the metadata server (same port)", 0.0,
         lambda f: f.restart("meta"), lambda f: None),
    Kind("link_down", "cut holder h2's link for 5 s", 5.0,
         lambda f: f.link("h2", False), lambda f: f.link("h2", True)),
    Kind("flood", "a burst of unique documents for 10 s: the working set outgrows the pool",
         10.0, lambda f: f.flood(True), lambda f: f.flood(False)),
    Kind("vllm_kill", "SIGKILL vLLM instance v1 while it saves, restart it", 0.0,
         lambda f: f.kill("v1"), lambda f: f.start("v1")),
    Kind("rolling_restart", "drain, restart and re-add v1 then v2 through the proxy's admin API",
         0.0, _rolling, lambda f: None),
)}


@dataclass
class Fault:
    """One scheduled fault and, once run, when it really began and ended (driver clock)."""

    kind: str
    at: float  #: seconds after the load started
    began: float | None = None
    ended: float | None = None
    error: str = ""

    def row(self) -> dict[str, Any]:
        return {"kind": self.kind, "at": self.at, "began": self.began, "ended": self.ended,
                "error": self.error, "what": KINDS[self.kind].what}


def schedule(kinds: list[str], seconds: float, warmup: float, repeat: int = 1,
             settle: float = SETTLE) -> list[Fault]:
    """Every kind ``repeat`` times, evenly spread after ``warmup``, the last ending
    ``settle`` s before the end (recovery must be measurable)."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; known: {sorted(KINDS)}")
    order = [k for _ in range(repeat) for k in kinds]
    if not order:
        return []
    span = max(1.0, seconds - warmup - settle)
    gap = span / len(order)
    return [Fault(k, round(warmup + i * gap, 1)) for i, k in enumerate(order)]


@dataclass
class FaultRunner:
    """Runs a schedule on its own thread against ``fleet``; times are ``clock()`` values."""

    fleet: Any
    faults: list[Fault]
    clock: Callable[[], float] = time.monotonic
    stop: threading.Event = field(default_factory=threading.Event)
    #: a fault begins at least this long after the previous one ended (its recovery is
    #: measured over the 30 s after it, the next one's level over the 30 s before): a fault
    #: that overran (a rolling restart on a loaded box) pushes the rest back instead of
    #: bunching them
    min_gap: float = 0.0
    #: seconds after the start by which a fault must begin, else it is skipped (recorded)
    deadline: float | None = None
    #: seconds after a fault's end its recovery is measured over (the load lasts that long)
    recovery: float = 0.0
    #: seconds after the start the load must last: while a fault runs, for ever; after the
    #: last one ended, ``recovery`` more (soak run J's second rolling restart ended 8 s after
    #: the load stopped, so its recovery went unmeasured)
    hold_until: float = 0.0
    _thread: threading.Thread | None = None

    def start(self, t0: float) -> FaultRunner:
        self._thread = threading.Thread(target=self._run, args=(t0,), name="soak-faults", daemon=True)
        self._thread.start()
        return self

    def _run(self, t0: float) -> None:
        last_end: float | None = None
        for fault in self.faults:
            due = fault.at if last_end is None else max(fault.at, last_end + self.min_gap)
            if self.deadline is not None and due > self.deadline:
                fault.error = f"skipped: due at {due:.0f} s, after the last start at {self.deadline:.0f} s"
                log.warning("fault %s %s", fault.kind, fault.error)
                continue
            if self.stop.wait(max(0.0, t0 + due - self.clock())):
                return
            kind = KINDS[fault.kind]
            fault.began = self.clock() - t0
            self.hold_until = float("inf")
            log.warning("fault %s begins: %s", fault.kind, kind.what)
            try:
                kind.begin(self.fleet)
                self.stop.wait(kind.duration)
                kind.end(self.fleet)
            except Exception as exc:  # noqa: BLE001 - recorded; the soak goes on
                fault.error = f"{type(exc).__name__}: {exc}"
                log.error("fault %s failed: %s", fault.kind, fault.error)
            fault.ended = last_end = self.clock() - t0
            self.hold_until = last_end + self.recovery
            log.warning("fault %s ended after %.1f s", fault.kind, fault.ended - fault.began)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
