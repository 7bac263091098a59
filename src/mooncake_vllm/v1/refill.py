"""Refill the pool from vLLM's own prefix cache after the pool lost blocks.

Blocks vLLM serves from its prefix cache in HBM are not saved again: this instance
saved them when it computed them. When the pool loses them — a master restart
empties it, a holder stalled past the master's ``client_ttl`` has its segment and
every block on it dropped — nothing would put them back while they stay hot in HBM:
the pool refilled only from misses, and the fleet's hit rate took 40–146 s to
recover (issue 27's soak). :class:`PoolAudit` checks a request's local-hit chunks
against the pool at most once per ``interval`` per chunk; the chunks from the first
one the pool lacks are then saved again from HBM with the request's other saves.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

__all__ = ["AUDIT_INTERVAL", "PoolAudit"]

#: seconds a chunk found in the pool is trusted to still be there
AUDIT_INTERVAL = 10.0
#: chunks remembered (least recently verified forgotten first)
_CAPACITY = 1 << 16


class PoolAudit:
    """When each chunk (digest) was last found in the pool."""

    def __init__(self, interval: float = AUDIT_INTERVAL, capacity: int = _CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.capacity = capacity
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def due_from(self, digests: Sequence[str]) -> int | None:
        """The first of ``digests`` not found in the pool within ``interval``, or ``None``."""
        now = self._clock()
        for i, digest in enumerate(digests):
            seen = self._seen.get(digest)
            if seen is None or now - seen >= self.interval:
                return i
        return None

    def forget(self) -> None:
        """Trust nothing seen so far (the pool was away: it may have come back empty)."""
        self._seen.clear()

    def found(self, digests: Sequence[str]) -> None:
        """``digests`` are in the pool now."""
        now = self._clock()
        for digest in digests:
            self._seen[digest] = now
            self._seen.move_to_end(digest)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
