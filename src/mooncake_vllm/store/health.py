"""Is the pool there? The breaker's state, its probe, and logs that say so once.

* :class:`PoolHealth` keeps the current :class:`~mooncake_vllm.store.breaker.Breaker`.
  While it is open no call reaches the pool; a background thread probes with one
  real, time-boxed call once the cool-down has passed (never the engine's
  threads), and closes the breaker on success. Each change of state is logged
  once: "unavailable (why)" and "reachable again".
* :class:`FailureLog` turns failures into at most one warning per cause per
  interval, with the count since the last one, so a full pool is a line a
  minute, not an error storm.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.stats import StoreStats
from mooncake_vllm.store.breaker import Breaker

__all__ = ["FailureLog", "PoolHealth"]

log = logging.getLogger(__name__)


class PoolHealth:
    """Breaker state plus its background probe."""

    def __init__(self, address: str, probe: Callable[[], bool], stats: StoreStats, *,
                 cooldown: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.address = address
        self._probe = probe
        self._stats = stats
        self._clock = clock
        self._lock = threading.Lock()
        self.breaker = Breaker(cooldown=cooldown)
        self._prober: threading.Thread | None = None
        self._closed = False

    def admit(self) -> bool:
        """Whether a call may go to the pool now; starts a probe when one is due."""
        with self._lock:
            breaker = self.breaker
            if breaker.allows():
                return True
            if breaker.probe_due(self._clock()) and self._prober is None and not self._closed:
                self._prober = threading.Thread(target=self._run_probe, name="mcv-probe",
                                                daemon=True)
                self._prober.start()
            return False

    def failed(self, why: str) -> None:
        """A call found the pool away: open the breaker (logged once per outage)."""
        with self._lock:
            was_open = self.breaker.is_open
            self.breaker = self.breaker.trip(self._clock(), why)
        self._stats.add("circuit_open")
        if not was_open:
            log.warning("Mooncake pool at %s unavailable (%s): serving misses and skipping "
                        "saves; vLLM recomputes until a probe finds it answering again",
                        self.address, why)

    def _run_probe(self) -> None:
        off_compute_cores()
        try:
            ok = self._probe()
        except Exception:  # noqa: BLE001 - a probe that raises is a failed probe
            ok = False
        with self._lock:
            self._prober = None
            if ok:
                recovered = self.breaker.is_open
                self.breaker = self.breaker.reset()
            else:
                recovered = False
                self.breaker = self.breaker.trip(self._clock(), self.breaker.reason)
        if recovered:
            log.warning("Mooncake pool at %s reachable again", self.address)

    def close(self) -> None:
        self._closed = True


class FailureLog:
    """At most one warning per cause every ``interval`` seconds, with counts."""

    def __init__(self, interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()
        self.lines = 0

    def ready(self, what: str) -> bool:
        """True at most once per interval for ``what``: gates extra work done only to log."""
        now = self._clock()
        with self._lock:
            last = self._last.get(what)
            if last is not None and now - last < self.interval:
                return False
            self._last[what] = now
            return True

    def warn(self, cause: str, message: str, count: int = 1) -> bool:
        """Log ``message`` unless ``cause`` was logged within the interval."""
        now = self._clock()
        with self._lock:
            last = self._last.get(cause)
            if last is not None and now - last < self.interval:
                self._suppressed[cause] = self._suppressed.get(cause, 0) + count
                return False
            self._last[cause] = now
            before = self._suppressed.pop(cause, 0)
            self.lines += 1
        more = f" ({before} more since the last such line)" if before else ""
        log.warning("%s%s", message, more)
        return True
