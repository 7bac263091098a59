"""Scheduler side of the V1 connector: lookups, load plans, save plans, delayed frees.

Pure logic over a ``lookup(keys) -> list[bool]`` callable (one batched existence
query), so it is unit-testable without vLLM or Mooncake.

* A request's prompt is cut into FULL chunks of ``block_size`` tokens; each chunk
  has a rank-independent chained digest (:func:`mooncake_vllm.keys.chunk_digests`).
* Lookup: the longest run of chunks, after what vLLM already has locally, whose
  keys exist for EVERY TP/PP rank; never the chunk holding the last prompt token
  (vLLM must compute at least one token).
* Loads are asynchronous where the release can report failed blocks of a
  background load (``load_async``): ``get_num_new_matched_tokens`` answers
  ``(n, True)``, vLLM parks the request (WAITING_FOR_REMOTE_KVS) and keeps
  stepping every other request, and the workers report it through
  ``get_finished``. A request finished (aborted) while its load still runs keeps
  its blocks until the workers say the load is over (``delayed_loads``), so no
  load ever writes into blocks vLLM gave to someone else. Elsewhere loads are
  synchronous: the worker loads them in ``start_load_kv`` before the forward
  pass of the step that schedules the request.
* Saves: every prompt chunk completed by a step is handed to the workers after
  that step's forward; a request with saves in flight keeps its blocks after it
  finishes (``request_finished`` → True) until the workers report them written.
* Refill (:mod:`~mooncake_vllm.v1.refill`): chunks vLLM serves from its own prefix
  cache are not saved again, unless the pool lost them (checked at most once per
  chunk per audit interval, off vLLM's thread: :mod:`~mooncake_vllm.v1.audits`): then
  they are saved again from HBM. Once the pool is
  back after an outage, or lost blocks while it stayed up (a holder's segment dropped:
  :mod:`~mooncake_vllm.v1.pool_loss`), every chunk vLLM's prefix cache still holds is
  re-saved without waiting for a request (``HbmRefill``, a bounded batch per step).
* Claims (:mod:`~mooncake_vllm.v1.claims`): a lookup's hit is claimed only as far
  as loading it is predicted to beat recomputing it (``load_policy``), from the
  step and load timings the workers report (``observe_perf``). Where no hit of the
  wanted span would be claimed, vLLM's thread does not look it up: a long span is asked
  on the admission's lane instead, and its saves skip what the pool holds.
* One load per block: while a background load of this instance brings chunks in,
  another request wanting any of them is deferred (``None``, where the release
  can) until that load is over; vLLM then serves them from its own prefix cache.
* ``save_admission: "repeat"`` (:mod:`~mooncake_vllm.v1.admission`): asked once per
  request off vLLM's thread; a step saves only the chunks seen before and tells the workers
  to mark the first sightings, capturing nothing of them.
* Hand-offs (the store flow's prefill → decode, :mod:`~mooncake_vllm.v1.handoff`):
  a prefill request that asks gets an offer in ``request_finished``'s
  ``kv_transfer_params`` and its workers publish a marker after its saves; a
  decode request carrying an offer is deferred (``None``) until the markers are
  read or ``handoff_timeout`` passes, then looked up as usual.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mooncake_vllm.keys import DigestMemo, RequestExtras, chunk_hex_digests
from mooncake_vllm.stats import CounterNames, Counters
from mooncake_vllm.v1.admission import (
    PRESENT,
    UNANSWERED,
    PresenceAdmission,
    RepeatAdmission,
    Verdicts,
    may_end_this_step,
)
from mooncake_vllm.v1.audits import AuditLane, LocalHitAudits
from mooncake_vllm.v1.claim_gate import ClaimGate
from mooncake_vllm.v1.claims import ClaimAdvisor, ClaimRules
from mooncake_vllm.v1.handoff import Handoffs, MarkerWaiter
from mooncake_vllm.v1.inflight import InflightLoads
from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata
from mooncake_vllm.v1.namespace import RankNamespaces, block_hashes, leading, request_extras
from mooncake_vllm.v1.perf import step_work
from mooncake_vllm.v1.pool_loss import PoolRefills
from mooncake_vllm.v1.refill import HbmRefill, PoolAudit
from mooncake_vllm.v1.request_state import RequestState

__all__ = ["COUNTERS", "MAX_SHARED_WAIT", "SKIP_LOOKUP_TOKENS", "RequestState", "SchedulerLogic"]

Lookup = Callable[[Sequence[str]], Sequence[bool]]

log = logging.getLogger(__name__)

#: longest a request waits for another request's load of its chunks (then it looks up)
MAX_SHARED_WAIT = 30.0
#: a lookup no hit of which would be claimed is not made on vLLM's thread (a round trip to the
#: master). A span of at most this many tokens is not asked at all: the saves capture it again
#: (<= 64 MiB of an 8B model's KV; the put skips what the pool holds). A longer one is asked on
#: the admission's lane (:mod:`.admission`), and its saves wait for the answer, so they do not
#: capture what the pool holds
SKIP_LOOKUP_TOKENS = 512
#: :attr:`SchedulerLogic.counters` (``handoff_*``: counted by :mod:`~mooncake_vllm.v1.handoff`)
COUNTERS = CounterNames(
    initial=("lookups", "hit_tokens", "load_jobs", "save_jobs", "local_hit_chunks_not_saved",
             "declined_tokens", "claims_declined_slow_pool", "claims_declined_never",
             "claims_declined_reach_probe", "claims_declined_measure_probe",
             "lookups_skipped_slow_pool", "claim_probes", "pool_probes", "waits_for_shared_load",
             "pool_audits", "pool_refill_chunks", "pool_refill_hbm_chunks", "pool_vanished_chunks",
             "pool_loss_refills", "pool_loss_refill_chunks"),
    later=frozenset({"failed_loads_not_retried", "perf_reports", "pool_audits_late",
                     # save_admission "repeat" (.admission)
                     "admission_lookups", "admission_lane_full", "admission_unanswered",
                     "admission_repeat_chunks", "admission_first_seen_chunks",
                     "admission_present_chunks", "admission_unanswered_chunks",
                     "admission_decided_at_save_chunks", "admission_late_chunks",
                     # save_admission "all": the spans not looked up (.admission)
                     "presence_lookups", "presence_lane_full", "presence_unanswered",
                     "presence_absent_chunks", "presence_present_chunks",
                     "presence_unanswered_chunks", "presence_decided_at_save_chunks",
                     "presence_late_chunks"}),
    families=(r"handoff_[a-z_]+",))


class SchedulerLogic:
    """The scheduler-side state machine of :class:`MooncakeStoreConnector`."""

    def __init__(self, namespaces: RankNamespaces, block_size: int, lookup: Lookup, *,
                 can_load: bool, can_save: bool, load_async: bool = False,
                 waiter: MarkerWaiter | None = None, handoff_timeout: float = 5.0,
                 pool_ready: Callable[[], bool] = lambda: True,
                 claims: ClaimAdvisor | None = None, can_defer: bool = False,
                 skip_lookup_upto: int = SKIP_LOOKUP_TOKENS,
                 audit_lane: AuditLane | None = None, save_admission: str = "all",
                 admission_lane: AuditLane | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.namespaces = namespaces
        self.block_size = block_size
        self.lookup = lookup
        self.can_load = can_load
        self.can_save = can_save
        self.load_async = load_async
        self.requests: dict[str, RequestState] = {}
        self._loads: list[BlockJob] = []
        self._delayed_loads: set[str] = set()
        self.counters = Counters(COUNTERS)
        self.claims = claims or ClaimAdvisor(ClaimRules("always"))
        self.gate = ClaimGate(self.claims, self.counters, block_size)
        #: the release answers ``None`` = ask again later (fact deferred_lookup)
        self.can_defer = can_defer
        self.skip_lookup_upto = skip_lookup_upto
        self._clock = clock
        #: a shared prefix is hashed once per process, not once per request (on vLLM's
        #: thread: a 2k-token prompt's digests took 0.2 ms on the dev box, 0.06 from the memo;
        #: found by vLLM's block hashes, its chunks are not visited at all)
        self._digests = DigestMemo.for_block_size(block_size)
        self._pool_ready = pool_ready
        self.audit = PoolAudit(clock=clock)
        self.refill = HbmRefill(clock=clock, live=self._live_prompts)
        #: each worker's pool state (``pool_up`` of its stats: 0 while its breaker is open); the
        #: workers may run in their own processes, with their own clients and breakers
        self.workers_up: dict[str, int] = {}
        self.refills = PoolRefills(namespaces, lambda keys: self.lookup(keys), self.counters,
                                   self.audit, self.refill, clock)
        #: audits of vLLM's own hits (:mod:`.audits`; ``audit_lane`` None: answered at once)
        self.audits = LocalHitAudits(namespaces, self.audit,
                                     audit_lane or AuditLane(lambda keys: self.lookup(keys), threaded=False),
                                     self.counters, self.refills.looked_up, pool_ready)
        #: ``save_admission`` decided here, before any capture: ``repeat`` for every request,
        #: ``all`` for the spans not looked up (None: a side that never saves)
        admission = RepeatAdmission if save_admission == "repeat" else PresenceAdmission
        self.admission = admission(
            namespaces, admission_lane or AuditLane(lambda keys: self.lookup(keys), threaded=False),
            self.counters) if can_save else None
        self._inflight = InflightLoads(clock, expire_after=4 * MAX_SHARED_WAIT)
        self.handoffs = Handoffs([ns.prefix() for ns in namespaces.namespaces], block_size,
                                 self.counters, offer=can_save,
                                 waiter=waiter if can_load else None,
                                 timeout=handoff_timeout, pool_ready=pool_ready)

    # ------------------------------------------------------------------ state
    def _state(self, request: Any) -> RequestState | None:
        req_id = request.request_id
        st = self.requests.get(req_id)
        if st is not None:
            return st
        tokens = getattr(request, "prompt_token_ids", None)
        if tokens is None:  # prompt embeddings: nothing to key by
            return None
        extras: RequestExtras = request_extras(request)
        digests = chunk_hex_digests(tokens, self.block_size, extras, self._digests,
                                    block_hashes(request))
        st = RequestState(req_id=req_id, prompt_len=len(tokens), digests=digests, request=request)
        self.requests[req_id] = st
        self.handoffs.on_new_request(request)
        return st

    def _live_prompts(self) -> list[tuple[list[str], Any]]:
        """The running requests' chunks with vLLM's block hashes (what a refill re-saves)."""
        if not self.can_save:
            return []
        return [(st.digests, block_hashes(st.request)) for st in self.requests.values()]

    # ------------------------------------------------------------------ lookup
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the pool can supply; ``(None, False)`` =
        ask again later (a hand-off still on its way)."""
        st = self._state(request) if self.can_load or self.can_save else None
        if st is None:
            return 0, False
        self._note_local_hits(st, num_computed_tokens)
        if self.can_save and st.local_upto:
            self.audits.ask(st.req_id, st.digests, st.local_upto)
        if (self.admission is not None and self.admission.asks_every_request
                and not self.handoffs.asked(st.req_id)):
            self.admission.ask(st.req_id, st.digests, st.local_upto)
        self.audits.apply(self.requests)
        if not self.can_load:
            return 0, False
        st.pending_load = None
        if st.promised and num_computed_tokens < st.promised:
            # asked again before vLLM ever ran with what we promised: the load failed
            st.promised, st.refuse_loads = 0, True
            self.counters["failed_loads_not_retried"] = self.counters.get(
                "failed_loads_not_retried", 0) + 1
        if st.refuse_loads:
            return 0, False
        bs = self.block_size
        claimable = st.claimable(bs)
        start = num_computed_tokens // bs
        if self.handoffs.defer(request, claimable, start):
            return None, False
        if start >= claimable:
            return 0, False
        wanted = st.digests[start:claimable]
        if self._waits_for_shared_load(st, wanted):
            return None, False
        if self._unprofitable(st, start, len(wanted)):
            return 0, False
        self.counters["lookups"] += 1
        hits = leading(self._present(wanted))
        self.handoffs.after_lookup(st.req_id, start + hits)
        if hits == 0:
            return 0, False
        if not self.handoffs.asked(st.req_id):
            # (a hand-off's decode reads every chunk; lost hits before ``start``: .audits saves them)
            st.present_upto = max(st.present_upto, start + hits)
        hits = self.gate.claim(start, hits, self.loading_tokens(),
                               probe=not self.handoffs.involves(st.req_id))
        if hits == 0:
            return 0, False
        st.pending_load = (start, hits, num_computed_tokens)
        return (start + hits) * bs - num_computed_tokens, self.load_async

    def _waits_for_shared_load(self, st: RequestState, wanted: Sequence[str]) -> bool:
        """Another request's background load brings some of ``wanted``: wait for it (once
        over, vLLM's own prefix cache has them), at most :data:`MAX_SHARED_WAIT` s."""
        if not self.can_defer or not self._inflight.brought_by_another(st.req_id, wanted):
            st.shared_wait_since = None
            return False
        now = self._clock()
        if st.shared_wait_since is None:
            st.shared_wait_since = now
            self.counters["waits_for_shared_load"] += 1
        return now - st.shared_wait_since < MAX_SHARED_WAIT

    def _unprofitable(self, st: RequestState, start: int, chunks: int) -> bool:
        """A span not even a hit of every chunk of which would be claimed: the pool is not
        asked on vLLM's thread (a round trip to the master, ~1 ms on an H200's loopback;
        most lookups of a serving engine are the few chunks after a prefix-cache hit, and
        on an H100 every recomputed 2k document was one). A short span
        (:data:`SKIP_LOOKUP_TOKENS`) is captured again by the saves; a longer one is asked
        on the admission's lane, whose answer keeps its saves from capturing what the pool
        holds (and counts the declined tokens)."""
        bs = self.block_size
        if self.handoffs.involves(st.req_id):
            return False  # a hand-off's decode reads what its prefill saved, and counts it
        long = chunks * bs > self.skip_lookup_upto
        if long and self.admission is None:
            return False  # a side that never saves: its lookup is what measures the pool
        if not self.gate.declines_every_hit(start, chunks, self.loading_tokens()):
            return False
        if long and self.admission is not None:
            known = self.admission.verdicts(st.req_id)
            if known is not None:  # answered before (a preempted request back): counted from it
                self._count_declined(st, start, known)
            else:
                st.unasked_from = start
                self.admission.ask(st.req_id, st.digests, start)
        return True

    def _unasked_answered(self, req_id: str, verdicts: Verdicts) -> None:
        """The admission's answer for a span not looked up, read as the lookup's would have
        been: the loss watch is told what it found, and its leading chunks the pool holds were
        a hit declined (counted; the claim policy is told, so it measures the pool again)."""
        st = self.requests.get(req_id)
        if st is None or st.unasked_from is None:
            return
        start, st.unasked_from = st.unasked_from, None
        if UNANSWERED not in verdicts.codes:
            self.refills.looked_up(st.digests[verdicts.start:verdicts.start + len(verdicts.codes)],
                                   [code == PRESENT for code in verdicts.codes],
                                   PRESENT in verdicts.codes)
        self._count_declined(st, start, verdicts)

    def _count_declined(self, st: RequestState, start: int, verdicts: Verdicts) -> None:
        """The leading chunks from ``start`` the answer found: a hit declined (counted; the
        claim policy is told, so it measures the pool again)."""
        self.gate.declined_unasked(
            start, verdicts.leading(PRESENT, start, st.claimable(self.block_size)))

    def loading_tokens(self) -> int:
        """Tokens of this instance's background loads not yet reported over (the backlog a
        new claim waits behind)."""
        return self._inflight.tokens()

    def observe_perf(self, perf: Any) -> None:
        """Step and load timings the workers measured (``PoolStats.data["perf"]``)."""
        if isinstance(perf, dict):
            self.counters["perf_reports"] += 1
            self.claims.observe(steps=perf.get("steps", ()), loads=perf.get("loads", ()),
                                probes=bool(perf.get("probes")))

    def loads_over(self, req_ids: Iterable[str], received: Iterable[str] = ()) -> None:
        """The workers report these requests' background loads over: their chunks are free;
        those ``received`` tell the claim policy how long a claimed load took."""
        received = set(received)
        for req_id, tokens, seconds in self._inflight.over(req_ids):
            if req_id in received:
                self.claims.observe_elapsed(tokens, seconds)

    def _note_local_hits(self, st: RequestState, num_computed_tokens: int) -> None:
        """Blocks vLLM serves from its own prefix cache need no second save (a 2k-token hit
        was 16-128 blocks gathered and looked up again for nothing), except for a hand-off:
        the decode instance reads every chunk from the pool, so they are saved (existing
        keys are skipped by the put)."""
        if not self.handoffs.asked(st.req_id):
            st.local_upto = num_computed_tokens // self.block_size

    def _present(self, digests: Sequence[str]) -> list[bool]:
        """Per chunk of ``digests``, whether the pool holds every rank's key (one lookup; the
        loss watch is told what it found)."""
        present = self.lookup(self.namespaces.keys_for(digests))
        found = self.namespaces.chunks_present(present, len(digests))
        self.refills.looked_up(digests, found, any(present))
        return found

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Turn an accepted lookup into a load job for the blocks vLLM allocated."""
        st = self._state(request)
        if st is None:
            return
        pending, st.pending_load = st.pending_load, None
        if num_external_tokens <= 0 or pending is None:
            return
        start, hits, computed = pending
        end = min(start + hits, -(-(computed + num_external_tokens) // self.block_size))
        block_ids = list(blocks.get_block_ids()[0])
        if end > len(block_ids):
            end = len(block_ids)
        if end <= start:
            return
        self._loads.append(BlockJob(st.req_id, st.digests[start:end], block_ids[start:end],
                                    background=self.load_async))
        if self.load_async:
            self._inflight.add(st.req_id, st.digests[start:end], (end - start) * self.block_size)
        st.loaded_upto = max(st.loaded_upto, end)
        st.promised = end * self.block_size
        self.counters["load_jobs"] += 1
        self.counters["hit_tokens"] += end * self.block_size - computed
        self.handoffs.note_hit(st.req_id, end * self.block_size - computed)

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self, scheduler_output: Any) -> MooncakeConnectorMetadata:
        """This step's loads (already planned) and saves (chunks this step completes)."""
        meta = MooncakeConnectorMetadata(loads=self._loads, delayed_loads=self._delayed_loads)
        self._loads, self._delayed_loads = [], set()
        meta.idle_step = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        if meta.idle_step:  # nothing to compute: sleep while hand-offs wait, never spin
            self.handoffs.idle()
        meta.preempted_req_ids = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        meta.preemptions_reported = hasattr(scheduler_output, "preempted_req_ids")
        for req_id in meta.preempted_req_ids:
            st = self.requests.get(req_id)
            if st is not None:
                st.block_ids = []
        self._keep_promises(scheduler_output)
        meta.step_work = step_work(scheduler_output)
        if self.can_load and self.claims.take_probe():  # declining: measure the pool meanwhile
            meta.probe_loads = True
            self.counters["pool_probes"] += 1
        if not self.can_save:
            return meta
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        self.audits.apply(self.requests)
        if self.admission is not None:
            for req_id, verdicts in self.admission.apply():
                self._unasked_answered(req_id, verdicts)
        scheduled = scheduler_output.num_scheduled_tokens
        ran: dict[str, int] = {}  # request -> its prompt chunks computed once this step ran
        for new in scheduler_output.scheduled_new_reqs:
            st = self.requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0]) if new.block_ids else []
            done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            ran[st.req_id] = min(done, st.prompt_len) // self.block_size
            self._plan_save(meta, st, done, block_state)
            self._declare(meta, st)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in resumed:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            ran[st.req_id] = min(done, st.prompt_len) // self.block_size
            self._plan_save(meta, st, done, block_state)
            self._declare(meta, st)
        # vLLM's own hits an audit found lost after their request's first saves (.audits)
        self.audits.plan(meta, self.requests, ran, lambda st: self._block_ids(st, block_state))
        # after an outage or a loss: what vLLM's prefix cache holds, saved again (.pool_loss)
        self.refills.step(meta, self._pool_ready() and all(self.workers_up.values()),
                          self._pool_ready)
        return meta

    def _declare(self, meta: MooncakeConnectorMetadata, st: RequestState) -> None:
        """Every full chunk of an asked request is with the workers (or came from the
        pool): they publish its hand-off marker after those saves."""
        declared = self.handoffs.declare(st.req_id, max(st.saved_upto, st.loaded_upto),
                                         st.digests)
        if declared is not None:
            meta.handoffs[st.req_id] = declared

    def _keep_promises(self, scheduler_output: Any) -> None:
        """A request vLLM schedules with what we promised to load got it: clear the promise."""
        cached = scheduler_output.scheduled_cached_reqs
        pairs = [(new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs]
        pairs += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in pairs:
            st = self.requests.get(req_id)
            if st is not None and st.promised and computed >= st.promised:
                st.promised = 0

    def _plan_save(self, meta: MooncakeConnectorMetadata, st: RequestState, done_tokens: int,
                   block_state: Any) -> None:
        end = min(done_tokens, st.prompt_len) // self.block_size
        begin = max(st.saved_upto, st.loaded_upto)
        # vLLM's own prefix-cache hits (saved before) and chunks the pool has (a declined claim)
        local = min(max(st.local_upto, st.present_upto), end) - begin
        if local > 0:
            self.counters["local_hit_chunks_not_saved"] += local
            begin = st.saved_upto = begin + local
        if end <= begin:
            return
        block_ids = self._block_ids(st, block_state)
        end = min(end, len(block_ids))
        if end <= begin:
            return
        if (self.admission is not None and not self.handoffs.asked(st.req_id)
                and self.admission.involves(st.req_id)):
            last = done_tokens >= st.prompt_len and may_end_this_step(st.request)
            job = self.admission.plan_save(meta, st, begin, end, block_ids, last_step=last)
        else:
            job = BlockJob(st.req_id, st.digests[begin:end], list(block_ids[begin:end]))
            st.saved_upto = end
        if job is None:
            return
        meta.saves.append(job)
        self.audit.found(job.digests)  # our own fresh saves: no refill race with them
        st.has_saves = True
        self.counters["save_jobs"] += 1

    @staticmethod
    def _block_ids(st: RequestState, block_state: Any) -> Sequence[int]:
        """The request's blocks now (vLLM's block state where the release passes it)."""
        if block_state is not None:
            current = block_state.get_block_ids(st.req_id)
            if current is not None:
                return current[0]
        return st.block_ids

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; keep its blocks while the workers may still use them.

        That is while saves may be reading them, or while a background load may
        still be writing them (vLLM has not yet been told the load is over). The
        second value goes to the answer's ``kv_transfer_params``: a prefill's
        hand-off offer, or a decode's hand-off report.
        """
        offer = self.handoffs.offer_for(request.request_id)
        params = offer or self.handoffs.finished(request.request_id)
        st = self.requests.pop(request.request_id, None)
        if st is None:
            return False, params
        if self.admission is not None:
            self.admission.finished(st.req_id, st.admission_wait_upto - st.saved_upto)
        if self.can_save:  # most recently used: re-saved first after an outage
            self.refill.remember(st.digests, block_hashes(request))
        loading = self.load_async and st.loaded_upto > 0 and _waiting_for_remote_kvs(request)
        if loading:
            self._delayed_loads.add(st.req_id)
        return bool(st.has_saves or loading), params

    def close(self) -> None:
        """Stop the hand-off waiter's, the audits' and the admission's threads."""
        if self.handoffs.waiter is not None:
            self.handoffs.waiter.close()
        self.audits.lane.close()
        if self.admission is not None:
            self.admission.lane.close()


def _waiting_for_remote_kvs(request: Any) -> bool:
    status = getattr(request, "status", None)
    return getattr(status, "name", str(status)).endswith("WAITING_FOR_REMOTE_KVS")
