"""``save_admission: "repeat"`` decided before anything is captured (the V1 scheduler side).

Under ``repeat`` a block is stored the second time any instance saves it; its first save
leaves only a mark (:func:`~mooncake_vllm.keys.seen_key`). Deciding that on the workers'
save threads (as V0 must, :meth:`~mooncake_vllm.store.client.StoreClient.commit_save`)
comes after the capture: every first sighting still cost vLLM's thread its launches and
the GPU its gather, checksums and device-to-host copy — on an H100, mixed serving with
``repeat`` was no faster than with every block stored (0.947 against 0.954 of no
connector), though it put no KV at all.

Here the scheduler asks once per request, when vLLM first looks it up, on a lane of its own
(one existence query to the master for every rank's chunk key and mark, off vLLM's thread:
:class:`~mooncake_vllm.v1.audits.AuditLane`), and reads the answer at its next hook. A
step that completes chunks then plans, per chunk: **seen** (every rank's mark is there)
→ saved as usual; **present** (every rank's chunk key is there) → nothing; **new** → the
workers put its marks (:attr:`MooncakeConnectorMetadata.marks`), no capture; **unanswered**
(the pool gave no answer) → nothing, counted. Until the answer is in, the request's saves
wait for a later step — its blocks are its own while vLLM runs it — unless this step may be
its last (its output budget ends with it): those chunks are captured and the save thread
decides, as before. A request that ends earlier anyway (a stop token) loses that save
(``admission_late_chunks``): a future miss, never wrong KV.

Under ``all`` (:class:`PresenceAdmission`) the same machinery spares a lookup: where the claim
policy would decline every hit of a long span (:data:`~mooncake_vllm.v1.scheduler.SKIP_LOOKUP_TOKENS`),
vLLM's thread does not ask the pool (a master round trip per request: on an H100 the first
requests of each mixed rep, the ones behind vLLM's recomputed documents, waited for eight of
them); the lane asks whether the pool holds the span's chunks, and a step saves only those it
lacks — what the lookup's answer did (``present_upto``), off vLLM's thread.

Hand-offs (the decode instance reads every chunk) and the refills of vLLM's prefix cache
never pass through here: they are always stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.keys import seen_key
from mooncake_vllm.stats import Counters
from mooncake_vllm.v1.audits import AuditLane, LaneAsk
from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata
from mooncake_vllm.v1.namespace import RankNamespaces

__all__ = ["ABSENT", "NEW", "PRESENT", "SEEN", "UNANSWERED", "AdmissionPlan", "PresenceAdmission",
           "RepeatAdmission", "Verdicts", "may_end_this_step"]

#: a chunk's verdict: its mark is in the pool (store it now)
SEEN = "s"
#: every rank's chunk key is in the pool (nothing to store)
PRESENT = "p"
#: neither: a first sighting (put its marks)
NEW = "n"
#: the pool gave no answer (``repeat``: store nothing; ``all``: store it)
UNANSWERED = "u"
#: ``all``: not every rank's chunk key is in the pool (store it now)
ABSENT = "a"
#: the scheduler counter each verdict adds a chunk to
_COUNTED = {SEEN: "admission_repeat_chunks", NEW: "admission_first_seen_chunks",
            PRESENT: "admission_present_chunks", UNANSWERED: "admission_unanswered_chunks"}


@dataclass(frozen=True)
class Verdicts:
    """The answer for a request's chunks ``[start, start + len(codes))``."""

    start: int
    codes: str

    def of(self, chunk: int) -> str:
        """The verdict of chunk ``chunk`` (outside the asked span: :data:`UNANSWERED`)."""
        i = chunk - self.start
        return self.codes[i] if 0 <= i < len(self.codes) else UNANSWERED

    def leading(self, code: str, begin: int, end: int) -> int:
        """How many chunks from ``begin`` (before ``end``) in a row have verdict ``code``."""
        run = self.codes[max(0, begin - self.start):max(0, end - self.start)]
        return len(run) - len(run.lstrip(code)) if begin >= self.start else 0


@dataclass
class AdmissionPlan:
    """What a step does with chunks ``[begin, end)`` of a request: the chunks to save and
    those whose marks to put; ``at_save``: no answer yet and this may be the request's last
    step, so all of them are captured and the save thread decides."""

    save: list[int]
    mark: list[int]
    at_save: bool = False


class RepeatAdmission:
    """The scheduler's asks and verdicts (vLLM's thread; the lane answers on its own)."""

    #: its scheduler counters are ``<prefix>_lookups``, ``<prefix>_lane_full``, ...
    prefix = "admission"
    #: the counter each verdict adds a chunk to
    counted = _COUNTED
    #: every request is asked when vLLM first looks it up (else only where a lookup was skipped)
    asks_every_request = True
    #: the verdicts whose chunks are saved
    saved = frozenset({SEEN})
    #: first sightings leave marks; a save decided on the save thread decides the same way
    marks = True

    def __init__(self, namespaces: RankNamespaces, lane: AuditLane, counters: Counters) -> None:
        self.namespaces = namespaces
        self.lane = lane
        self.counters = counters
        self._asked: set[str] = set()  #: requests whose answer is on its way
        self._verdicts: dict[str, Verdicts] = {}

    def ask(self, req_id: str, digests: Sequence[str], start: int) -> None:
        """Ask about the request's chunks ``[start, len(digests))`` (once per request)."""
        if req_id in self._asked or req_id in self._verdicts:
            return
        chunks = list(digests[start:])
        if not chunks:
            self._verdicts[req_id] = Verdicts(start, "")
            return
        keys = self._keys(self.namespaces.keys_for(chunks))
        if not self.lane.submit(LaneAsk(req_id, start, chunks, keys)):
            self._verdicts[req_id] = Verdicts(start, UNANSWERED * len(chunks))
            self.counters[f"{self.prefix}_lane_full"] += 1
            return
        self._asked.add(req_id)
        self.counters[f"{self.prefix}_lookups"] += 1

    def involves(self, req_id: str) -> bool:
        """Whether the request's saves are planned here."""
        return True

    def verdicts(self, req_id: str) -> Verdicts | None:
        """The request's answer, once read (``None``: not asked, or on its way)."""
        return self._verdicts.get(req_id)

    def apply(self) -> list[tuple[str, Verdicts]]:
        """Fold the lane's answers in (vLLM's thread); the requests answered now."""
        answered = []
        for answer in self.lane.take():
            if answer.req_id not in self._asked:
                continue  # finished meanwhile (counted then)
            self._asked.discard(answer.req_id)
            verdicts = Verdicts(answer.start, self._codes(answer.present, len(answer.digests)))
            self._verdicts[answer.req_id] = verdicts
            answered.append((answer.req_id, verdicts))
        return answered

    @staticmethod
    def _keys(keys: list[str]) -> list[str]:
        """What the lane asks for chunk keys ``keys``: each key and each mark."""
        return keys + [seen_key(k) for k in keys]

    def _answered(self, present: Sequence[bool] | None, n: int, per_chunk: int) -> bool:
        if present is None or len(present) != per_chunk * n * len(self.namespaces.namespaces):
            self.counters[f"{self.prefix}_unanswered"] += 1
            return False
        return True

    def _codes(self, present: Sequence[bool] | None, n: int) -> str:
        if not self._answered(present, n, 2):
            return UNANSWERED * n
        assert present is not None
        half = len(present) // 2
        stored = self.namespaces.chunks_present(present[:half], n)
        seen = self.namespaces.chunks_present(present[half:], n)
        return "".join(PRESENT if s else SEEN if m else NEW for s, m in zip(stored, seen))

    def plan(self, req_id: str, begin: int, end: int, *, last_step: bool) -> AdmissionPlan | None:
        """Chunks ``[begin, end)`` just computed: what to save and what to mark; ``None``: no
        answer yet, and a later step runs the request (wait for it)."""
        verdicts = self._verdicts.get(req_id)
        if verdicts is None:
            if not last_step:
                return None
            self.counters[f"{self.prefix}_decided_at_save_chunks"] += end - begin
            return AdmissionPlan(list(range(begin, end)), [], at_save=True)
        out = AdmissionPlan([], [])
        for chunk in range(begin, end):
            code = verdicts.of(chunk)
            if code in self.saved:
                out.save.append(chunk)
            elif code == NEW:
                out.mark.append(chunk)
            self.counters[self.counted[code]] += 1
        return out

    def plan_save(self, meta: MooncakeConnectorMetadata, st: Any, begin: int, end: int,
                  block_ids: Sequence[int], *, last_step: bool) -> BlockJob | None:
        """The scheduler's save of request ``st``'s chunks ``[begin, end)`` (just computed,
        in ``block_ids``): the job of those seen before (``None``: none), the first sightings'
        marks in ``meta.marks``; with no answer yet, nothing (``st.saved_upto`` stays, a later
        step that runs the request plans them)."""
        plan = self.plan(st.req_id, begin, end, last_step=last_step)
        if plan is None:
            st.admission_wait_upto = end
            return None
        st.saved_upto = end
        meta.marks.extend(st.digests[i] for i in plan.mark)
        if not plan.save:
            return None
        return BlockJob(st.req_id, [st.digests[i] for i in plan.save],
                        [block_ids[i] for i in plan.save],
                        ask_admission=plan.at_save and self.marks)

    def finished(self, req_id: str, unsaved: int) -> None:
        """The request is over; ``unsaved`` of its computed chunks were never planned (their
        answer came too late)."""
        self._asked.discard(req_id)
        self._verdicts.pop(req_id, None)
        if unsaved > 0:
            self.counters[f"{self.prefix}_late_chunks"] += unsaved


class PresenceAdmission(RepeatAdmission):
    """``save_admission: "all"``: asked only for a span the scheduler did not look up (its
    every hit declined): chunks the pool holds are not saved again, the others are — and so
    are those the pool gave no answer for, or none by the request's last step (the put skips
    what the pool holds). Only a request that ends unforeseen (a stop token) before the answer
    loses its save (``presence_late_chunks``)."""

    prefix = "presence"
    counted = {ABSENT: "presence_absent_chunks", PRESENT: "presence_present_chunks",
               UNANSWERED: "presence_unanswered_chunks"}
    asks_every_request = False
    saved = frozenset({ABSENT, UNANSWERED})
    marks = False

    def involves(self, req_id: str) -> bool:
        return req_id in self._asked or req_id in self._verdicts

    @staticmethod
    def _keys(keys: list[str]) -> list[str]:
        return keys

    def _codes(self, present: Sequence[bool] | None, n: int) -> str:
        if not self._answered(present, n, 1):
            return UNANSWERED * n
        assert present is not None
        return "".join(PRESENT if s else ABSENT
                       for s in self.namespaces.chunks_present(present, n))


def may_end_this_step(request: Any) -> bool:
    """Whether the step that completes ``request``'s prompt may be its last: its output
    budget allows at most one more token (unknown: yes)."""
    max_tokens = getattr(request, "max_tokens", None)
    if max_tokens is None:
        params = getattr(request, "sampling_params", None)
        max_tokens = getattr(params, "max_tokens", None)
    if not isinstance(max_tokens, int):
        return True
    produced = getattr(request, "num_output_tokens", 0)
    return not isinstance(produced, int) or max_tokens - produced <= 1
