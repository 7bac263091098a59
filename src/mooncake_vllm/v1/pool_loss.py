"""The scheduler's re-saves from HBM, and noticing blocks lost while the pool stayed up.

:class:`~.refill.HbmRefill` re-saves what vLLM's prefix cache still holds once the pool is
back after an outage (the breakers saw it away). A holder stalled past the master's
``client_ttl`` (or killed) loses its segment and every block on it while the master and
the other holders keep answering: no outage, so no sweep, and the pool got those blocks
back only as requests recomputed them (soak run I: a 10 s ``holder_stop`` took 34.8 s to
recover; the target is 30). :class:`LossWatch` notices such a loss from two signals:

* a lookup that reached the pool (it found some keys) misses at least
  :data:`MIN_VANISHED` chunks an earlier lookup of this instance found there within
  :data:`VANISH_HORIZON` s (``pool_vanished_chunks``; the master answers a dropped
  segment's blocks as plain misses, so no miss cause is counted for them);
* a worker's :class:`~mooncake_vllm.store.holders.HolderGuard` found a suspended holder's
  blocks no longer listed by the master (``pool_segments_dropped`` in the workers' stats).

Either asks :meth:`~.refill.HbmRefill.lost` for the outage's sweep, at most once per
:data:`~.refill.LOSS_GAP` s (``pool_loss_refills``, ``pool_loss_refill_chunks``, one log
line per sweep). :class:`PoolRefills` runs the sweeps in the scheduler's steps.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from mooncake_vllm.v1.metadata import BlockJob
from mooncake_vllm.v1.refill import HbmRefill, PoolAudit

if TYPE_CHECKING:
    from mooncake_vllm.stats import Counters
    from mooncake_vllm.v1.metadata import MooncakeConnectorMetadata
    from mooncake_vllm.v1.namespace import RankNamespaces

__all__ = ["MIN_VANISHED", "VANISH_HORIZON", "WORKER_DROPS", "LossWatch", "PoolRefills"]

#: seconds a chunk a lookup found is expected to stay (an older one may have been evicted)
VANISH_HORIZON = 120.0
#: chunks found earlier that one lookup must miss to count as a loss (not one stray eviction)
MIN_VANISHED = 4
#: the workers' counter of holders whose blocks the master dropped (``v1/metrics``)
WORKER_DROPS = "pool_segments_dropped"
_CAPACITY = 1 << 16


class LossWatch:
    """Chunks this instance's lookups found in the pool, and why a sweep is wanted."""

    def __init__(self, *, horizon: float = VANISH_HORIZON, min_vanished: int = MIN_VANISHED,
                 capacity: int = _CAPACITY, clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon = horizon
        self.min_vanished = min_vanished
        self.capacity = capacity
        self._clock = clock
        self._found: OrderedDict[str, float] = OrderedDict()
        #: how the loss was noticed, until a sweep takes it (``None``: no loss seen)
        self.pending: str | None = None

    def looked_up(self, digests: Sequence[str], found: Sequence[bool],
                  reached: bool | None = None) -> int:
        """A lookup's answer (``found``: per chunk, every rank's key there; ``reached``: it
        found any key at all, default ``any(found)``): how many chunks found within
        ``horizon`` it missed (``0`` for a lookup that found nothing: a failed lookup
        answers all-miss and proves nothing)."""
        if not digests or not (any(found) if reached is None else reached):
            return 0
        now = self._clock()
        vanished = 0
        for digest, here in zip(digests, found):
            if here:
                self._found[digest] = now
                self._found.move_to_end(digest)
                continue
            seen = self._found.pop(digest, None)
            vanished += seen is not None and now - seen <= self.horizon
        while len(self._found) > self.capacity:
            self._found.popitem(last=False)
        if vanished >= self.min_vanished:
            self.pending = f"a lookup missed {vanished} chunks found in the pool before"
        return vanished

    def workers_report(self, counters: Mapping[str, int]) -> None:
        """The workers' counter deltas of one step (their stats)."""
        if counters.get(WORKER_DROPS, 0) > 0:
            self.pending = "a worker found a stalled holder's blocks dropped by the master"

    def forget(self) -> None:
        """The pool was away (what a restarted master lacks is the outage sweep's), or a sweep
        took this loss: what was found before it is no measure any more (soak run J: chunks
        lost with the segment and no longer in vLLM's cache, missed by later lookups, started
        a second sweep 30 s after the first that re-saved nothing)."""
        self._found.clear()
        self.pending = None


class PoolRefills:
    """Each step's sweep of vLLM's prefix cache (:class:`~.refill.HbmRefill`): after an
    outage, and after a loss :class:`LossWatch` noticed."""

    def __init__(self, namespaces: RankNamespaces, lookup: Callable[[Sequence[str]], Sequence[bool]],
                 counters: Counters, audit: PoolAudit, refill: HbmRefill,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.namespaces = namespaces
        self.lookup = lookup
        self.counters = counters
        self.audit = audit
        self.refill = refill
        self.losses = LossWatch(clock=clock)
        #: blocks of the last steps' loads: a failed synchronous load leaves vLLM's block
        #: cached under its hash until vLLM hears of it, so the refill never reads them
        self._recent_loads: deque[set[int]] = deque(maxlen=4)
        self._jobs = 0

    def looked_up(self, digests: Sequence[str], found: Sequence[bool], reached: bool) -> None:
        """A scheduler lookup's answer (not the sweep's own): per chunk, every rank's key there
        (:meth:`~.namespace.RankNamespaces.chunks_present`); ``reached``: any key found."""
        self.counters["pool_vanished_chunks"] += self.losses.looked_up(digests, found, reached)

    def step(self, meta: MooncakeConnectorMetadata, ready: bool,
             pool_ready: Callable[[], bool]) -> None:
        """Look up a bounded batch of the chunks vLLM's prefix cache holds and save those the
        pool lacks from their blocks, with this step's saves. ``ready``: the pool answers this
        step's scheduler and every worker; ``pool_ready``: the scheduler's view, now."""
        self._recent_loads.append({b for job in meta.loads for b in job.block_ids})
        # the workers put the refill's saves: it starts once they reach the pool too (run H: their
        # breakers closed up to 22 s after the scheduler's, and saves meanwhile were dropped)
        if self.refill.observe(ready):
            self.audit.forget()  # a restarted master kept nothing the audit found
        if not ready:
            self.losses.forget()
        elif self.losses.pending is not None:
            before = self.refill.timeline
            if self.refill.lost(self.losses.pending):  # taken (else: rate-limited, kept)
                self.counters["pool_loss_refills"] += self.refill.timeline is not before
                self.losses.forget()
        if not self.refill.sweeping:
            return
        batch = self.refill.take(set().union(*self._recent_loads))
        digests = [digest for digest, _ in batch]
        present = self.lookup(self.namespaces.keys_for(digests)) if batch else []
        if batch and not pool_ready():
            return  # away again: the next step's observe ends this sweep
        n = len(batch)
        lost = [(d, b) for (d, b), here in zip(batch, self.namespaces.chunks_present(present, n))
                if not here]
        if lost:
            self._jobs += 1
            meta.saves.append(BlockJob(f"mcv-refill-{self._jobs}", [d for d, _ in lost],
                                       [b for _, b in lost], unheld=True))
            self.counters["pool_refill_hbm_chunks"] += len(lost)
            if self.refill.timeline is not None and self.refill.timeline.cause:
                self.counters["pool_loss_refill_chunks"] += len(lost)
        self.audit.found(digests)
        self.refill.done_step(len(lost), n - len(lost))
