"""A degraded pool mid-run: the reader's request loop and the driver's fault schedule.

The reader serves pool hits one after another for ``seconds`` (one of the shared
documents each, vLLM's own prefix cache reset before each, so every request asks
the pool), stamping each request's start, TTFT and tokens from the pool. The
driver, meanwhile, SIGSTOPs every holder but the first at ``stop_at`` seconds and
SIGCONTs them at ``resume_at`` (a hung peer: gets to their values stall until the
time box ends them). With ``load_policy`` auto the claims stop within a few
requests (TTFT back to recompute's) and come back after recovery.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["FaultSchedule", "degraded_loop", "holder_pids"]


def holder_pids(pattern: str) -> list[int]:
    """Pids from the holders' pid files (scripts/gpu/mc_up.sh), the first holder first."""
    out = []
    for path in sorted(glob.glob(pattern), key=lambda p: (len(p), p)):
        try:
            out.append(int(open(path).read().strip()))
        except (OSError, ValueError):
            continue
    return out


def degraded_loop(llm: Any, docs: list[list[int]], seconds: float,
                  make_req: Callable[[list[int]], Any], serve: Callable[[Any, list[Any]], None]
                  ) -> list[dict[str, Any]]:
    """Pool hits back to back for ``seconds``; one record per request."""
    engine, out, t0, i = llm.llm_engine, [], time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        # every request asks the pool, never vLLM's own cache: the reset is refused while
        # blocks are still held (a save in flight), so step until it is done
        settle = time.monotonic()
        while not llm.reset_prefix_cache() and time.monotonic() - settle < 30:
            engine.step()
            time.sleep(0.002)
        r = make_req(docs[i % len(docs)])
        start = time.monotonic() - t0
        serve(engine, [r])
        out.append({"t": start, "ttft_s": r.ttft(), "cached": r.cached, "n": len(r.prompt)})
        i += 1
    return out


class FaultSchedule:
    """SIGSTOP holders ``pids[1:]`` at ``stop_at`` s, SIGCONT them at ``resume_at`` s."""

    def __init__(self, pids: list[int], stop_at: float, resume_at: float) -> None:
        self.pids, self.stop_at, self.resume_at = pids[1:], stop_at, resume_at
        self.events: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stop = threading.Event()

    def start(self) -> FaultSchedule:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _signal(self, sig: int, what: str) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except OSError as exc:
                self.events.append({"t": time.monotonic() - self._t0, "error": str(exc)})
        self.events.append({"t": time.monotonic() - self._t0, "what": what, "pids": self.pids})

    def _run(self) -> None:
        if self._stop.wait(self.stop_at):
            return
        self._signal(signal.SIGSTOP, "SIGSTOP")
        self._stop.wait(max(0.0, self.resume_at - self.stop_at))
        self._signal(signal.SIGCONT, "SIGCONT")

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the schedule's end (SIGCONT always sent) and return what happened."""
        self._stop.set()
        self._thread.join(5)
        if not any(e.get("what") == "SIGCONT" for e in self.events) and \
                any(e.get("what") == "SIGSTOP" for e in self.events):
            self._signal(signal.SIGCONT, "SIGCONT")
        return self.events
