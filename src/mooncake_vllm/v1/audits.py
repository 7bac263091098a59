"""Audits of vLLM's own prefix-cache hits against the pool, off vLLM's thread.

A request vLLM serves from its prefix cache is not saved again: this instance saved those
chunks when it computed them. The pool may have lost them since (a master restart, a holder's
segment dropped, eviction), and nothing would put them back while they stay hot in HBM, so
each such chunk is checked at most once per :data:`~.refill.AUDIT_INTERVAL`
(:class:`~.refill.PoolAudit`). The check is one existence query to the master, a round trip
that vLLM's thread paid inside its lookup hook (~2.6 ms each on an H100's loopback, 8–16 per
mixed-serving rep; the whole time box when the master hangs). Here one thread asks
(:class:`AuditLane`); the answers are read on vLLM's thread at its next hook
(:meth:`LocalHitAudits.apply`): chunks still present are trusted for another interval; from
the first one missing, the request's chunks are saved again from its own blocks, as a job
of their own in a step that runs the request (its blocks are its own then; after a preemption,
only the chunks that step has computed again). A request that finished before a step ran it
is counted (``pool_audits_late``): the next request on that prefix audits it again, since
nothing missing was marked found.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.stats import Counters
from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata
from mooncake_vllm.v1.namespace import RankNamespaces, leading
from mooncake_vllm.v1.refill import PoolAudit

__all__ = ["BATCH_KEYS", "AuditLane", "LaneAsk", "LocalHitAudits", "MAX_QUEUED"]

log = logging.getLogger(__name__)

#: audits waiting for the lane's thread; more are not asked (they stay due)
MAX_QUEUED = 64
#: the most keys one query of the lane carries: asks waiting together go in one query (a wave
#: of new requests under ``repeat`` was one master round trip and two thread hand-offs each)
BATCH_KEYS = 2048


@dataclass
class LaneAsk:
    """One existence query of a request's chunks (an audit, or a ``repeat`` admission's ask)."""

    req_id: str
    start: int  #: the request's chunk index of ``digests[0]``
    digests: list[str]
    #: what is asked: every rank's key of every chunk (:meth:`RankNamespaces.keys_for`),
    #: then (an admission's ask) their marks
    keys: list[str]
    present: list[bool] | None = field(default=None)  #: per key; None: no answer


class AuditLane:
    """One daemon thread (``name``) that runs existence queries; :meth:`take` hands the answers
    back. Asks that wait together are answered by one query (at most :data:`BATCH_KEYS` keys).
    ``threaded=False`` answers at :meth:`submit` (tests; a release without threads)."""

    def __init__(self, lookup: Callable[[Sequence[str]], Sequence[bool] | None], *,
                 threaded: bool = True, max_queued: int = MAX_QUEUED, name: str = "mcv-audit") -> None:
        self._lookup = lookup
        self._name = name
        self._threaded = threaded
        self._asked: queue.Queue[LaneAsk | None] = queue.Queue(maxsize=max_queued)
        self._answers: queue.SimpleQueue[LaneAsk] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, audit: LaneAsk) -> bool:
        """Ask; ``False``: too many are waiting (not asked)."""
        if not self._threaded:
            self._answer([audit])
            return True
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        try:
            self._asked.put_nowait(audit)
        except queue.Full:
            return False
        return True

    def take(self) -> list[LaneAsk]:
        """The answers that came since the last call."""
        out: list[LaneAsk] = []
        while not self._answers.empty():  # (vLLM's thread asks at every hook: no raise)
            try:
                out.append(self._answers.get_nowait())
            except queue.Empty:
                break
        return out

    def close(self) -> None:
        """Stop the thread: audits still waiting are dropped (each is due again anyway)."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is None:
            return
        while True:  # room for the stop item, and nothing queued before it
            try:
                self._asked.get_nowait()
            except queue.Empty:
                break
        self._asked.put_nowait(None)
        thread.join(5.0)

    def _run(self) -> None:
        off_compute_cores()
        while True:
            first = self._asked.get()
            if first is None:
                return
            batch, keys = [first], len(first.keys)
            while keys < BATCH_KEYS:  # and those waiting behind it, in the same query
                try:
                    more = self._asked.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._answer(batch)
                    return
                batch.append(more)
                keys += len(more.keys)
            self._answer(batch)

    def _answer(self, batch: list[LaneAsk]) -> None:
        keys = [key for audit in batch for key in audit.keys]
        present: list[bool] | None = None
        try:  # None: the pool gave no answer
            answer = self._lookup(keys)
            present = None if answer is None else list(answer)
        except Exception as exc:  # noqa: BLE001 - an unanswered audit is asked again later
            log.debug("mooncake-vllm: pool audit failed: %s", exc)
        if present is not None and len(present) != len(keys):
            present = None  # not an answer to these keys
        at = 0
        for audit in batch:
            n = len(audit.keys)
            audit.present = None if present is None else present[at:at + n]
            at += n
            self._answers.put(audit)


class LocalHitAudits:
    """The scheduler's audits of vLLM's prefix-cache hits: asked on the lane, applied to the
    requests (and the next step's saves) on vLLM's thread."""

    def __init__(self, namespaces: RankNamespaces, audit: PoolAudit, lane: AuditLane,
                 counters: Counters, looked_up: Callable[[Sequence[str], Sequence[bool], bool], None],
                 pool_ready: Callable[[], bool]) -> None:
        self.namespaces = namespaces
        self.audit = audit
        self.lane = lane
        self.counters = counters
        self._looked_up = looked_up  #: the loss watch hears every lookup's answer
        self._pool_ready = pool_ready
        self._resaves: list[tuple[str, int, int]] = []  # (req_id, first chunk, end) to save again

    def ask(self, req_id: str, digests: Sequence[str], local: int) -> None:
        """Audit the request's chunks ``[0, local)`` (vLLM's own hits) where due."""
        if not self._pool_ready():  # away: a master restarted meanwhile keeps nothing we saw
            self.audit.forget()
            return
        due = self.audit.due_from(digests, local)
        if due is None:
            return
        chunks = list(digests[due:local])
        if not self.lane.submit(LaneAsk(req_id, due, chunks, self.namespaces.keys_for(chunks))):
            return  # the lane is busy: still due, asked again by the next request on them
        self.counters["pool_audits"] += 1
        self.audit.found(chunks)  # trusted while asked: other requests do not ask again

    def apply(self, requests: dict[str, Any]) -> None:
        """Fold the lane's answers in (vLLM's thread): the requests whose hits the pool lost
        save them again, from the first chunk missing."""
        for answer in self.lane.take():
            n = len(answer.digests)
            if answer.present is None or not (any(answer.present) or self._pool_ready()):
                self.audit.unfound(answer.digests)  # unanswered: due again
                continue
            found = self.namespaces.chunks_present(answer.present, n)
            self._looked_up(answer.digests, found, any(answer.present))
            here = leading(found)
            if here == n:
                continue
            self.audit.unfound(answer.digests[here:])
            self.counters["pool_refill_chunks"] += n - here
            st = requests.get(answer.req_id)
            if st is None:
                self.counters["pool_audits_late"] += 1
                continue
            gap = answer.start + here
            st.pool_gap = gap if st.pool_gap is None else min(st.pool_gap, gap)
            st.present_upto = min(st.present_upto, gap)
            # vLLM's own hits are never planned as saves (a pool load may follow them): the
            # lost ones are saved again as a job of their own, once a step runs the request
            self._resaves.append((st.req_id, gap, answer.start + n))

    def plan(self, meta: MooncakeConnectorMetadata, requests: dict[str, Any], done: Mapping[str, int],
             block_ids_of: Callable[[Any], Sequence[int]]) -> None:
        """This step's saves of hits the pool lost, from the blocks of requests this step runs
        (``done``: their chunks computed once its forward ran): a request not scheduled now
        may have been preempted, its blocks freed, so it waits for a step that runs it."""
        resaves, self._resaves = self._resaves, []
        for req_id, begin, end in resaves:
            st = requests.get(req_id)
            if st is None:  # finished before a step ran it: the next request on it asks again
                self.counters["pool_audits_late"] += 1
                continue
            if req_id not in done:
                self._resaves.append((req_id, begin, end))
                continue
            blocks = block_ids_of(st)
            upto = min(end, done[req_id], len(blocks))  # never a block still being filled
            if upto < end:  # resumed after a preemption: the rest once computed again
                self._resaves.append((req_id, max(begin, upto), end))
            if upto <= begin:
                continue
            meta.saves.append(BlockJob(req_id, list(st.digests[begin:upto]), list(blocks[begin:upto])))
            self.audit.found(st.digests[begin:upto])  # our own fresh saves
            st.has_saves = True
            self.counters["save_jobs"] += 1

    def pending(self) -> Iterable[tuple[str, int, int]]:
        """Saves of lost hits waiting for the next step (tests)."""
        return tuple(self._resaves)
