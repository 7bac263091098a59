"""What the claim policy learns from a worker: how long its forward steps and loads took.

The scheduler names each step's work in the metadata (``step_work``: scheduled
tokens ``Σm``, attention work ``Σm·(p + m/2)`` and the furthest position computed); the worker times the step
from ``start_load_kv`` to ``wait_for_save`` — on CUDA with events on vLLM's
stream (GPU time, read once the events completed, never waited for), on the host
with the clock — and each load's transfer. Samples go to the scheduler with the
connector stats (``PoolStats.data["perf"]``), where
:class:`~mooncake_vllm.v1.claims.ClaimAdvisor` fits its models.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mooncake_vllm.v1.claim_models import MIN_FIT, MIN_PREFILL

__all__ = ["DECODE_EVERY", "MAX_PENDING", "SLOW_FAILURE", "StepTimer", "step_work"]

#: samples kept between two reports (a stalled front end never grows us unbounded)
MAX_PENDING = 256
#: a failed load that took at least this long (seconds) is a sample of a slow pool
SLOW_FAILURE = 1.0
#: one in this many decode steps is timed: the claim policy takes their median as a step's
#: fixed cost (:class:`~.claim_models.PrefillModel`), which a sample tells as well as all of
#: them, and on CUDA each timed step costs vLLM's thread two events (inferred, not measured:
#: ``bind_connector_metadata`` took 56 us per step on an H100 against 7-10 us on the host clock)
DECODE_EVERY = 4


class StepTimer:
    """Times forward steps and loads of one worker; :meth:`take` hands the samples over."""

    def __init__(self, *, cuda_device: Any = None, decode_every: int = DECODE_EVERY,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._device = cuda_device
        self._decode_every = decode_every
        self._decodes = 0  # decode steps seen (one in ``decode_every`` is timed)
        self._clock = clock
        self._lock = threading.Lock()
        self._open: tuple[tuple[float, ...], Any] | None = None  # the step's work, start mark
        self._unread: deque[tuple[tuple[float, ...], Any, Any]] = deque(maxlen=MAX_PENDING)
        self._steps: list[list[float]] = []
        self._loads: list[list[float]] = []
        #: this worker runs background load probes when the scheduler asks (reported with
        #: the samples, so the claim policy explores with probes instead of requests)
        self.probes = False

    def _mark(self) -> Any:
        if self._device is None:
            return self._clock()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def step_began(self, work: tuple[float, ...] | None) -> None:
        """``bind_connector_metadata``: the forward of a step with this work (the scheduler's
        ``step_work``: tokens first) follows. Not ``start_load_kv``: vLLM >= 0.32 calls it
        after launching the forward when the step has no synchronous loads. Timed: prefill
        steps the policy fits (``MIN_FIT`` tokens or more) and one in ``decode_every`` decode
        steps; the steps between teach it nothing and are not timed."""
        self._open = (tuple(map(float, work)), self._mark()) if work and self._wanted(work[0]) else None

    def _wanted(self, tokens: float) -> bool:
        if tokens >= MIN_FIT:
            return True
        if tokens <= 0 or tokens >= MIN_PREFILL:
            return False
        self._decodes += 1
        return self._decodes % self._decode_every == 1 % self._decode_every

    def step_ended(self) -> None:
        """``wait_for_save``: the forward pass of the open step has been issued (or ran)."""
        if self._open is None:
            return
        work, start = self._open
        self._open = None
        end = self._mark()
        with self._lock:
            self._unread.append((work, start, end))

    def load_done(self, tokens: int, seconds: float, loaded: int | None = None) -> None:
        """One load's transfer (loader thread or ``start_load_kv``) of ``tokens``, of which
        ``loaded`` arrived (default all). A partly failed load says nothing of the pool's
        speed (missing values fail fast) and is left out, unless it took long: then it
        was slow (deadlines passed) and counts as such."""
        if loaded is not None and loaded < tokens and seconds < SLOW_FAILURE:
            return
        if tokens > 0 and seconds > 0:
            with self._lock:
                if len(self._loads) < MAX_PENDING:
                    self._loads.append([float(tokens), float(seconds)])

    def take(self) -> dict[str, Any] | None:
        """Steps whose timing is known (CUDA: events completed) and loads since the last call
        (``probes``: present and true where this worker runs background probes)."""
        with self._lock:
            while self._unread:
                work, start, end = self._unread[0]
                if self._device is None:
                    seconds = end - start
                elif end.query():
                    seconds = start.elapsed_time(end) / 1e3
                else:
                    break  # still running on the GPU: next time
                self._unread.popleft()
                if len(self._steps) < MAX_PENDING:
                    self._steps.append([*work, seconds])
            steps, loads, self._steps, self._loads = self._steps, self._loads, [], []
        if not (steps or loads):
            return None
        return {"steps": steps, "loads": loads, **({"probes": True} if self.probes else {})}


def step_work(scheduler_output: Any) -> tuple[float, float, float]:
    """``(Σm, Σm·(p + m/2), reach)`` over the step's requests (``m`` tokens scheduled from
    ``p``); ``reach``: the furthest position a prefill (``m > 1``) of the step computes."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    cached = scheduler_output.scheduled_cached_reqs
    pairs = [(new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs]
    pairs += list(zip(cached.req_ids, cached.num_computed_tokens))
    tokens = work = reach = 0.0
    for req_id, computed in pairs:
        m = scheduled.get(req_id, 0)
        tokens += m
        work += m * (computed + m / 2)
        if m > 1:
            reach = max(reach, float(computed + m))
    return tokens, work, reach
