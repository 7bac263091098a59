"""Refill the pool from vLLM's own prefix cache after the pool lost blocks.

Blocks vLLM serves from its prefix cache in HBM are not saved again: this instance
saved them when it computed them. When the pool loses them — a master restart
empties it, a holder stalled past the master's ``client_ttl`` has its segment and
every block on it dropped — nothing would put them back while they stay hot in HBM:
the pool refilled only from misses, and the fleet's hit rate took 40–146 s to
recover (issue 27's soak). :class:`PoolAudit` checks a request's local-hit chunks
against the pool at most once per ``interval`` per chunk; the chunks from the first
one the pool lacks are then saved again from HBM with the request's other saves.
:class:`HbmRefill` does not wait for requests: once the pool is back after an outage it
re-saves every chunk vLLM's prefix cache still holds, a bounded batch per step; the same
sweep runs (:meth:`HbmRefill.lost`, rate-limited) when blocks were lost while the pool stayed
up — a holder's segment dropped (:mod:`.pool_loss` notices it).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from typing import Any

__all__ = ["AUDIT_INTERVAL", "LOSS_GAP", "REFILL_GAP", "REFILL_PASSES", "RESAVE_PER_STEP",
           "HbmRefill", "PoolAudit", "Timeline", "cached_block"]

log = logging.getLogger(__name__)

#: seconds a chunk found in the pool is trusted to still be there
AUDIT_INTERVAL = 10.0
#: chunks remembered (least recently verified forgotten first)
_CAPACITY = 1 << 16
#: chunks :class:`HbmRefill` looks up (and re-saves, where the pool lacks them) per step
RESAVE_PER_STEP = 64
#: passes over vLLM's cache after an outage, ``REFILL_GAP`` s apart (holders re-mount late)
REFILL_PASSES = 3
REFILL_GAP = 5.0
#: seconds between the starts of two sweeps after losses while the pool stayed up (a pool that
#: keeps evicting what vLLM still caches would otherwise be swept again and again)
LOSS_GAP = 30.0


class PoolAudit:
    """When each chunk (digest) was last found in the pool.

    A prefix found whole is remembered as such until its oldest chunk's trust runs out, so
    the next request on it asks in O(1), not per chunk (a 2k-token document is 128 chunks
    at block size 16); anything that makes a chunk less trusted (:meth:`unfound`,
    :meth:`forget`, a chunk forgotten for capacity) forgets every such prefix."""

    def __init__(self, interval: float = AUDIT_INTERVAL, capacity: int = _CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.capacity = capacity
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()
        #: (first digest, last digest, length) -> (generation, trusted until) of whole prefixes
        self._whole: dict[tuple[str, str, int], tuple[int, float]] = {}
        self._generation = 0  #: bumped whenever a chunk becomes less trusted

    def due_from(self, digests: Sequence[str], end: int | None = None) -> int | None:
        """The first of ``digests[:end]`` not found in the pool within ``interval``, or
        ``None``."""
        end = len(digests) if end is None else min(end, len(digests))
        if end <= 0:
            return None
        now = self._clock()
        prefix = (digests[0], digests[end - 1], end)
        whole = self._whole.get(prefix)
        if whole is not None and whole[0] == self._generation and now < whole[1]:
            return None
        seen_at, oldest = self._seen.get, now
        for i in range(end):
            seen = seen_at(digests[i])
            if seen is None or now - seen >= self.interval:
                return i
            oldest = min(oldest, seen)
        if len(self._whole) >= self.capacity:
            self._whole.clear()
        self._whole[prefix] = (self._generation, oldest + self.interval)
        return None

    def forget(self) -> None:
        """Trust nothing seen so far (the pool was away: it may have come back empty)."""
        self._seen.clear()
        self._generation += 1

    def unfound(self, digests: Sequence[str]) -> None:
        """``digests`` are not known to be in the pool (due at the next check)."""
        for digest in digests:
            self._seen.pop(digest, None)
        self._generation += 1

    def found(self, digests: Sequence[str]) -> None:
        """``digests`` are in the pool now."""
        now = self._clock()
        for digest in digests:
            self._seen[digest] = now
            self._seen.move_to_end(digest)
        if len(self._seen) > self.capacity:
            self._generation += 1
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)


class HbmRefill:
    """After the pool was away, re-save what vLLM's prefix cache still holds (issue 27).

    The audit above re-saves a chunk only when a request touches it: a master
    restart's empty pool then refilled at the workload's pace (run G: 54.7 s to
    recover). Here every chunk this instance saw is remembered with vLLM's block
    hash (a finished request's at its end, the running ones' when a sweep starts); once
    the pool answers again (:meth:`observe`), :meth:`take` hands out up to
    ``per_step`` of them per step, most recently used first, each with the block
    vLLM's prefix cache holds under that hash NOW (``resolve``; ``None`` = evicted:
    skipped). The caller looks them up and saves those the pool lacks from those
    blocks in the same step's saves, so a block's bytes are those its hash (and our
    key) names when the save captures them; the workers' checksums catch a block
    reused while a put still reads it. Nothing is held: a block evicted later is a
    save the put drops, never a wrong value. The master answers before its holders
    have mounted their segments again, so puts of the first pass may not land: a
    pass that re-saved anything is followed, ``gap`` seconds later, by another
    (at most ``passes``), which saves only what is still missing. :meth:`lost` starts
    the same sweep while the pool stays up (a holder's segment dropped), at most once per
    ``loss_gap`` seconds.
    """

    def __init__(self, *, per_step: int = RESAVE_PER_STEP, capacity: int = _CAPACITY,
                 passes: int = REFILL_PASSES, gap: float = REFILL_GAP, loss_gap: float = LOSS_GAP,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 live: Callable[[], Iterable[tuple[Sequence[str], Sequence[Any]]]] = tuple) -> None:
        self.per_step = per_step
        #: the running requests' ``(digests, block hashes)``: remembered when a sweep starts,
        #: not on every new request (on vLLM's thread: 23 µs a 2k-token prompt, dev box)
        self.live = live
        self.capacity = capacity
        self.passes = passes
        self.gap = gap
        self.loss_gap = loss_gap
        self._last_loss: float | None = None
        #: vLLM's cached block for a block hash, or ``None`` (bound by the connector)
        self.resolve: Callable[[Any], int | None] | None = None
        self._clock = clock
        self._wall = wall
        self._hashes: OrderedDict[str, Any] = OrderedDict()  # digest -> vLLM block hash
        self._due: list[str] = []  # digests still to re-save in this pass, the next one last
        self._next_pass_at: float | None = None
        self._ready: bool | None = None
        self.timeline: Timeline | None = None
        #: the last finished timeline's log line (tests, the soak's logs)
        self.last_line = ""

    def remember(self, digests: Sequence[str], block_hashes: Sequence[Any]) -> None:
        """``digests[i]`` is named ``block_hashes[i]`` in vLLM's prefix cache."""
        pairs = list(zip(digests, block_hashes))
        for digest, block_hash in reversed(pairs):  # the sweep meets a prefix's first chunk first
            self._hashes[digest] = block_hash
            self._hashes.move_to_end(digest)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def observe(self, ready: bool) -> bool:
        """This step's pool state; ``True`` when it just came back after being away."""
        was, self._ready = self._ready, ready
        now = self._clock()
        if not ready and was:
            if self.timeline is not None:  # away again mid-sweep
                self._finish(now, "interrupted")
            self.timeline = Timeline(lost_at=now, lost_wall=self._wall())
        if not (ready and was is False):
            return False
        t = self.timeline
        if t is None:  # away since start: nothing was saved before
            return False
        t.back_at = now
        if self.resolve is None:
            self._finish(now, "no access to vLLM's prefix cache (vLLM < 0.32): the audit "
                              "re-saves chunks as requests touch them")
            return True
        self._start_pass(t)
        return True

    def lost(self, why: str) -> bool:
        """Blocks were lost while the pool stayed up (``why``: how it was noticed): sweep
        vLLM's cache as after an outage. ``False`` = not now (the pool is away, or the last
        such sweep started less than ``loss_gap`` s ago): ask again later; ``True`` = taken
        (a sweep started, one already runs, or vLLM's cache cannot be read here)."""
        now = self._clock()
        if self._ready is False or (self.timeline is not None and self.timeline.back_at is None):
            return False  # away: the outage's own sweep follows
        if self.sweeping or self.resolve is None:
            return True
        if self._last_loss is not None and now - self._last_loss < self.loss_gap:
            return False
        self._last_loss = now
        self.timeline = Timeline(lost_at=now, lost_wall=self._wall(), back_at=now, cause=why)
        self._start_pass(self.timeline)
        return True

    def _start_pass(self, t: Timeline) -> None:
        for digests, block_hashes in self.live():  # running now: the most recently used
            self.remember(digests, block_hashes)
        self._due = list(self._hashes)  # popped from the end: most recent first
        self._next_pass_at = None
        t.passes += 1
        if t.passes == 1:
            t.queued = len(self._due)

    def take(self, skip_blocks: Set[int] = frozenset()) -> list[tuple[str, int]]:
        """Up to ``per_step`` due ``(digest, block id)`` pairs still in vLLM's cache."""
        t = self.timeline
        if t is None or self.resolve is None:
            return []
        if not self._due and self._next_pass_at is not None and \
                self._clock() >= self._next_pass_at:
            self._start_pass(t)
        if not self._due:
            return []
        if t.started_at is None:
            t.started_at = self._clock()
        out: list[tuple[str, int]] = []
        examined = 0
        while self._due and len(out) < self.per_step and examined < 16 * self.per_step:
            examined += 1
            digest = self._due.pop()
            block_hash = self._hashes.get(digest)
            try:
                block = None if block_hash is None else self.resolve(block_hash)
            except Exception:  # noqa: BLE001 - an unreadable cache entry is a chunk not re-saved
                block = None
            if block is None or block in skip_blocks:
                t.evicted += t.passes == 1
                continue
            out.append((digest, block))
        return out

    def done_step(self, resaved: int, present: int) -> None:
        """Of the last :meth:`take`, ``resaved`` were handed to the workers, ``present``
        the pool still had."""
        t = self.timeline
        if t is None:
            return
        if t.passes == 1:
            t.resaved += resaved
            t.present += present
        else:
            t.later += resaved
        t.pass_resaved += resaved
        if self._due or self._next_pass_at is not None:
            return
        now = self._clock()
        if t.pass_resaved and t.passes < self.passes:  # check that those puts landed
            t.pass_resaved = 0
            self._next_pass_at = now + self.gap
        else:
            self._finish(now, "done")

    @property
    def sweeping(self) -> bool:
        return bool(self._due) or self._next_pass_at is not None

    def _finish(self, now: float, how: str) -> None:
        t, self.timeline = self.timeline, None
        self._due, self._next_pass_at = [], None
        if t is None:
            return

        def rel(at: float | None) -> str:
            return "-" if at is None else f"+{at - t.lost_at:.1f} s"
        lost = time.strftime("%H:%M:%S", time.localtime(t.lost_wall))
        what = (f"blocks lost while the pool stayed up ({t.cause}) at {lost}" if t.cause else
                f"pool lost at {lost}, back at {rel(t.back_at)}")
        self.last_line = (
            f"mooncake-vllm: pool refill from HBM: {what}, re-save started "
            f"{rel(t.started_at)}, {t.resaved} of "
            f"{t.queued} remembered chunks re-saved ({t.present} still in the pool, "
            f"{t.evicted} no longer in vLLM's cache), {t.passes} pass(es) (the later ones "
            f"re-saved {t.later} whose puts had not landed), {how} at {rel(now)}")
        log.warning("%s", self.last_line)


@dataclass
class Timeline:
    """One outage of the pool (or, with a ``cause``, one loss of blocks while it stayed up), as
    the scheduler saw it (monotonic seconds; counts: of the first pass)."""

    lost_at: float
    lost_wall: float
    back_at: float | None = None
    started_at: float | None = None
    queued: int = 0
    resaved: int = 0
    present: int = 0
    evicted: int = 0
    passes: int = 0
    later: int = 0  #: re-saved by later passes (the first pass's puts had not landed)
    pass_resaved: int = 0  #: re-saved by the current pass
    cause: str = ""  #: how a loss while the pool stayed up was noticed ("": an outage)


def cached_block(block_pool: Any) -> Callable[[Any], int | None]:
    """The block vLLM's prefix cache holds under a block hash now (its one KV cache group:
    the connector refuses hybrid models), or ``None``; ``block_pool``: vLLM's ``BlockPool``."""
    def resolve(block_hash: Any) -> int | None:
        blocks = block_pool.get_cached_block(block_hash, [0])
        if not blocks or getattr(blocks[0], "is_null", False):
            return None
        return int(blocks[0].block_id)

    return resolve
