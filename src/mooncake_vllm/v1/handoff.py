"""The prefill → decode hand-off of the store flow (XpYd through the pool), scheduler side.

Without it a decode instance looks its prompt up the moment the proxy forwards
the request, while the prefill instance's saves may still be on their way: it
finds nothing and recomputes the whole prompt. With it:

1. The proxy asks the prefill instance for a hand-off
   (:func:`~mooncake_vllm.handoff_protocol.ask_params` in the request's
   ``kv_transfer_params``).
2. The prefill's scheduler gives the request a hand-off id; once every full
   chunk of the prompt is handed to the workers it *declares* the hand-off
   (``MooncakeConnectorMetadata.handoffs``), and ``request_finished`` returns
   the :class:`~mooncake_vllm.handoff_protocol.Offer` (id, namespaces, chunk
   count) in ``kv_transfer_params``.
3. Each prefill worker, after its save thread committed every earlier save of
   that request (one FIFO), checks which chunks are present and publishes a
   small marker (:func:`~mooncake_vllm.handoff_protocol.handoff_key`,
   :func:`~mooncake_vllm.handoff_protocol.marker_value`), ``present < chunks``
   when saves failed — the decode stops waiting at once.
4. The proxy passes the offer to the decode request. The decode's scheduler
   answers ``None`` ("ask again later", vLLM >= 0.10.2: fact ``deferred_lookup``)
   while :class:`MarkerWaiter` polls for every rank's marker on its own thread,
   at most ``handoff_timeout`` seconds; then it looks the chunks up as usual and
   claims only what is present (loads verify every block). A wait that ends
   without the blocks is a fallback: counted by reason, one log line.

The marker is a readiness signal, never a claim: what the decode loads is what
its own lookup finds. Requests without an offer (plain clients) are untouched.
What travels between the instances is :mod:`mooncake_vllm.handoff_protocol`;
this module is the state machine of each side.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.handoff_protocol import (
    Offer,
    asks_for_handoff,
    handoff_key,
    parse_marker,
    report_params,
)
from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.store.timebox import STALL_GRACE

__all__ = [
    "IDLE_WAIT",
    "STALL_BOUND",
    "Handoffs",
    "MarkerWaiter",
    "WaitResult",
    "pool_ready",
    "store_probe",
]

log = logging.getLogger(__name__)

#: one log line per fallback, at most one per this many seconds per reason (all are counted;
#: the next line says how many went unlogged)
_LOG_INTERVAL = 1.0
_POLL_SECONDS = 0.005
#: longest sleep of a step that schedules nothing while a decode request waits for its
#: markers: spinning through empty steps took ~1.5 of a 2-core box's cores and starved the
#: prefill's save thread (its few-ms saves took seconds: the hand-offs of issue 27 timed out)
IDLE_WAIT = 0.02
#: the furthest past its deadline a wait for markers goes (after a stall, see MarkerWaiter)
STALL_BOUND = 4 * STALL_GRACE


@dataclass(frozen=True)
class WaitResult:
    """How a wait for markers ended: ``ready`` (all ranks' markers read) or ``timeout``."""

    outcome: str
    waited: float
    present: int = -1  #: fewest leading chunks present over the ranks' markers (-1: unknown)


Probe = Callable[[Sequence[str]], Sequence["bytes | None"]]


def store_probe(source: Any) -> Probe:
    """A :class:`MarkerWaiter` probe over a shared client (``source.get()``):
    :meth:`~mooncake_vllm.store.StoreClient.take_markers`."""
    def probe(keys: Sequence[str]) -> Sequence[bytes | None]:
        client = source.get()
        return [None] * len(keys) if client is None else client.take_markers(keys)

    return probe


def pool_ready(source: Any) -> Callable[[], bool]:
    """Whether ``source.get()`` is a client that currently talks to the pool."""
    def ready() -> bool:
        client = source.get()
        return client is not None and bool(client.healthy)

    return ready


@dataclass
class _Watch:
    keys: list[str]
    deadline: float
    started: float
    found: dict[str, int]
    overdue_since: float | None = None  #: when the deadline was first found passed


class MarkerWaiter:
    """Polls the pool for hand-off markers on one thread; never blocks the caller.

    ``probe(keys)`` returns each marker's payload or ``None`` (one batched
    existence query, then a read of those present). A wait times out only on a look
    taken at most :data:`~mooncake_vllm.store.timebox.STALL_GRACE` before its deadline, or
    later: after a stall of this process or the machine the first poll would otherwise find
    every deadline passed before looking again. :meth:`result` enforces the deadline too
    (at most :data:`STALL_BOUND` after finding it passed), so a hung pool never stretches a wait further.
    """

    def __init__(self, probe: Probe, *, poll_seconds: float = _POLL_SECONDS,
                 clock: Callable[[], float] = time.monotonic, background: bool = True) -> None:
        self._probe = probe
        self._background = background  # False: the caller runs poll_once (tests)
        self._poll = poll_seconds
        self._clock = clock
        self._cond = threading.Condition()
        self._watches: dict[str, _Watch] = {}
        self._results: dict[str, WaitResult] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._looked = float("-inf")  #: when the last poll's look began

    def _over(self, w: _Watch, now: float) -> bool:
        """The wait is over without its markers: past the deadline and looked near it or
        since, or STALL_BOUND after the deadline was first found passed without a look."""
        if now < w.deadline:
            return False
        if w.overdue_since is None:
            w.overdue_since = now
        return self._looked >= w.deadline - STALL_GRACE or now >= w.overdue_since + STALL_BOUND

    def watch(self, req_id: str, keys: Sequence[str], timeout: float) -> None:
        now = self._clock()
        with self._cond:
            self._results.pop(req_id, None)
            self._watches[req_id] = _Watch(list(keys), now + timeout, now, {})
            if self._thread is None and self._background and not self._closed:
                self._thread = threading.Thread(target=self._loop, name="mcv-handoff",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def result(self, req_id: str) -> WaitResult | None:
        """The wait's end (taken once), or ``None`` while it goes on."""
        now = self._clock()
        with self._cond:
            done = self._results.pop(req_id, None)
            if done is not None:
                return done
            w = self._watches.get(req_id)
            if w is None:
                return WaitResult("timeout", 0.0)
            if not self._over(w, now):
                return None
            del self._watches[req_id]
            return WaitResult("timeout", now - w.started)

    def wait_any(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until some wait has ended (``True``) or nothing is
        watched any more; ``False`` when the time ran out."""
        with self._cond:
            return self._cond.wait_for(
                lambda: bool(self._results) or not self._watches or self._closed, timeout)

    def cancel(self, req_id: str) -> None:
        with self._cond:
            self._watches.pop(req_id, None)
            self._results.pop(req_id, None)

    def poll_once(self) -> None:
        """One round: read every pending marker, settle the waits that are over."""
        with self._cond:
            pending = {k for w in self._watches.values() for k in w.keys if k not in w.found}
        keys = sorted(pending)
        looked = self._clock()
        try:
            values = list(self._probe(keys)) if keys else []
        except Exception as exc:  # noqa: BLE001 - a failed poll is a marker not seen yet
            log.debug("mooncake-vllm: polling hand-off markers failed: %s", exc)
            values = [None] * len(keys)
        seen = {k: p for k, v in zip(keys, values) if (p := parse_marker(v)) is not None}
        now = self._clock()
        with self._cond:
            self._looked = max(self._looked, looked)
            for req_id, w in list(self._watches.items()):
                w.found.update({k: seen[k] for k in w.keys if k in seen})
                if len(w.found) == len(w.keys):
                    self._results[req_id] = WaitResult("ready", now - w.started,
                                                       min(w.found.values()))
                elif self._over(w, now):
                    self._results[req_id] = WaitResult("timeout", now - w.started)
                else:
                    continue
                del self._watches[req_id]
                self._cond.notify_all()

    def _loop(self) -> None:
        off_compute_cores()
        while True:
            with self._cond:
                while not self._watches and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            self.poll_once()
            with self._cond:
                if self._watches and not self._closed:
                    self._cond.wait(self._poll)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass
class _DecodeState:
    offer: Offer | None
    expected: int = 0  #: chunks the offer lets this request claim (from chunk 0)
    waiting: bool = False
    outcome: str = "none"
    waited: float = 0.0
    marker_present: int = -1
    hit_tokens: int = 0


class Handoffs:
    """Both roles of the hand-off inside :class:`~mooncake_vllm.v1.scheduler.SchedulerLogic`.

    Prefill (``offer``): ids for requests that ask, declarations, the offer.
    Decode (``waiter``): defer a request until its offer's markers are read.
    """

    def __init__(self, prefixes: Sequence[str], block_size: int, counters: dict[str, int], *,
                 offer: bool = False, waiter: MarkerWaiter | None = None, timeout: float,
                 pool_ready: Callable[[], bool] = lambda: True) -> None:
        self.prefixes = tuple(prefixes)
        self.block_size = block_size
        self.counters = counters
        self.offer = offer
        self.waiter = waiter if timeout > 0 else None
        self.timeout = timeout
        self.pool_ready = pool_ready
        self._ids: dict[str, str] = {}  # prefill: req_id -> hand-off id (asked)
        self._declared: dict[str, int] = {}  # prefill: req_id -> chunks declared
        self._decode: dict[str, _DecodeState] = {}
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def _count(self, name: str, amount: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    # ------------------------------------------------------------------ prefill
    def on_new_request(self, request: Any) -> None:
        if self.offer and asks_for_handoff(getattr(request, "kv_transfer_params", None)):
            self._ids[request.request_id] = uuid.uuid4().hex

    def asked(self, req_id: str) -> bool:
        """Whether this prefill request asked for a hand-off (its chunks must reach the pool)."""
        return req_id in self._ids

    def involves(self, req_id: str) -> bool:
        """Whether the request is a hand-off's prefill (it asked) or its decode (an offer)."""
        st = self._decode.get(req_id)
        return self.asked(req_id) or (st is not None and st.offer is not None)

    def declare(self, req_id: str, covered: int, digests: Sequence[str]) -> tuple[str, list[str]] | None:
        """``(id, digests)`` once chunks ``[0, covered)`` cover every full chunk of an asked
        request (its saves are all with the workers): the workers publish the marker."""
        hid = self._ids.get(req_id)
        if hid is None or req_id in self._declared or not digests or covered < len(digests):
            return None
        self._declared[req_id] = len(digests)
        return hid, list(digests)

    def offer_for(self, req_id: str) -> dict[str, Any] | None:
        """``kv_transfer_params`` for the prefill's answer (asked requests only)."""
        hid = self._ids.pop(req_id, None)
        chunks = self._declared.pop(req_id, 0)
        if hid is None:
            return None
        state = "saving" if chunks else "none"
        if chunks and not self.pool_ready():
            state, chunks = "unavailable", 0
        self._count("handoff_offers")
        return Offer(hid, self.prefixes, chunks, state).to_params()

    # ------------------------------------------------------------------ decode
    def idle(self, timeout: float = IDLE_WAIT) -> None:
        """A step that schedules nothing while requests wait for markers: sleep until a
        wait ends (at most ``timeout``) instead of spinning the engine through empty steps
        (vLLM steps again at once while a request is deferred)."""
        if self.waiter is not None and any(st.waiting for st in self._decode.values()):
            self.waiter.wait_any(timeout)

    def defer(self, request: Any, claimable: int, start: int) -> bool:
        """True while the request must wait for its offer's markers (answer ``None``)."""
        req_id = request.request_id
        st = self._decode.get(req_id)
        if st is None:
            st = self._decode[req_id] = self._start(request, claimable, start)
        if not st.waiting:
            return False
        assert self.waiter is not None
        res = self.waiter.result(req_id)
        if res is None:
            return True
        st.waiting, st.waited, st.marker_present = False, res.waited, res.present
        self._count("handoff_wait_us", round(res.waited * 1e6))
        if res.outcome == "timeout":
            self._fallback(st, req_id, "timeout")
        else:
            st.outcome = "ready"
            self._count("handoff_ready")
        return False

    def _start(self, request: Any, claimable: int, start: int) -> _DecodeState:
        offer = Offer.from_params(getattr(request, "kv_transfer_params", None))
        if offer is None:
            return _DecodeState(None)
        if isinstance(offer, str):
            st = _DecodeState(None)
            self._fallback(st, request.request_id, offer)
            return st
        st = _DecodeState(offer, expected=min(offer.chunks, claimable))
        self._count("handoff_offers_received")
        if set(offer.namespaces) != set(self.prefixes):
            self._fallback(st, request.request_id, "namespace_mismatch")
        elif offer.state == "unavailable":
            self._fallback(st, request.request_id, "prefill_unavailable")
        elif st.expected <= start:
            st.outcome = "nothing_to_wait_for"
        elif self.waiter is None:
            st.outcome = "not_waited"  # handoff_timeout 0 or a release without deferral
            self._count("handoff_not_waited")
        else:
            keys = [handoff_key(p, offer.handoff_id) for p in self.prefixes]
            self.waiter.watch(request.request_id, keys, self.timeout)
            st.waiting = True
            self._count("handoff_waits")
        return st

    def after_lookup(self, req_id: str, covered_chunks: int) -> None:
        """The lookup after the wait found chunks ``[0, covered_chunks)``: a shortfall
        against the offer is a fallback (the prefill failed, or blocks went missing)."""
        st = self._decode.get(req_id)
        if st is None or st.offer is None or st.outcome != "ready":
            return
        if covered_chunks < st.expected:
            reason = "prefill_failed" if 0 <= st.marker_present < st.expected else "missing"
            self._fallback(st, req_id, reason)

    def note_hit(self, req_id: str, tokens: int) -> None:
        st = self._decode.get(req_id)
        if st is not None:
            st.hit_tokens = tokens

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """Forget the request; for a decode request with an offer, its hand-off report
        (returned as ``kv_transfer_params``: a non-streamed answer shows it)."""
        self._ids.pop(req_id, None)
        self._declared.pop(req_id, None)
        st = self._decode.pop(req_id, None)
        if st is None:
            return None
        if st.waiting and self.waiter is not None:
            self.waiter.cancel(req_id)
        if st.offer is None and st.outcome == "none":
            return None
        return report_params(st.outcome, st.waited, st.hit_tokens)

    def _fallback(self, st: _DecodeState, req_id: str, reason: str) -> None:
        st.outcome = reason
        self._count(f"handoff_fallback_{reason}")
        now = time.monotonic()
        if now - self._last_log.get(reason, -_LOG_INTERVAL) < _LOG_INTERVAL:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return
        self._last_log[reason] = now
        more = self._unlogged.pop(reason, 0)
        log.warning("mooncake-vllm: hand-off of request %s: %s after %.3f s; vLLM recomputes "
                    "what the pool lacks (counter handoff_fallback_%s%s)", req_id,
                    _EXPLAIN.get(reason, reason), st.waited, reason,
                    f"; {more} more since the last line" if more else "")


_EXPLAIN = {
    "timeout": "the prefill instance's blocks did not arrive within handoff_timeout",
    "prefill_failed": "the prefill instance could not save every block",
    "prefill_unavailable": "the prefill instance had no pool connection",
    "missing": "blocks the prefill instance saved are gone from the pool",
    "namespace_mismatch": "the prefill instance keys blocks in other namespaces "
                          "(model, dtype, layout, block size or TP/PP differ)",
    "bad_offer": "kv_transfer_params carry a malformed hand-off",
}
