"""The circuit breaker: a small immutable policy the client only asks.

Modelled on urllib3's ``Retry``: :meth:`Breaker.trip` and :meth:`Breaker.reset`
return a new policy, the client keeps the current one and asks
:meth:`Breaker.allows` before every call. While open, nothing is sent to the
pool; once the cool-down has passed, :meth:`Breaker.probe_due` says a probe (one
real, time-boxed call made off the engine's threads) may test the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Breaker"]


@dataclass(frozen=True)
class Breaker:
    """Closed (``opened_at is None``) or open since ``opened_at`` (monotonic seconds)."""

    cooldown: float = 3.0
    #: the longest wait between probes of a pool that stays away: a probe is one tiny call on
    #: a background thread, and every second the breaker stays open after the pool is back
    #: is seconds of misses (a restarted master: 60 s here held the fleet's hit rate down for
    #: 30-37 s after the restart, issue 27)
    max_cooldown: float = 10.0
    opened_at: float | None = None
    trips: int = 0  #: consecutive trips without a success (backs the cool-down off)
    reason: str = ""

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def current_cooldown(self) -> float:
        return min(self.max_cooldown, self.cooldown * (2 ** max(0, self.trips - 1)))

    def allows(self) -> bool:
        """Whether a normal call may go to the pool: only when closed, however long it
        has been open (only a successful probe, :meth:`reset`, closes it)."""
        return self.opened_at is None

    def probe_due(self, now: float) -> bool:
        """Open, and cooled down long enough that one probe may test the pool."""
        return self.opened_at is not None and now - self.opened_at >= self.current_cooldown()

    def trip(self, now: float, reason: str) -> Breaker:
        """Open (again): the cool-down doubles with each consecutive trip."""
        return replace(self, opened_at=now, trips=self.trips + 1, reason=reason)

    def reset(self) -> Breaker:
        """Closed after a success."""
        return replace(self, opened_at=None, trips=0, reason="")
