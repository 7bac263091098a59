"""Claim only what pays: pool tokens are claimed when loading them beats recomputing them.

Pure logic over measurements the workers report (:mod:`~mooncake_vllm.v1.perf`)
and a clock, so it is testable with a fake clock and made-up samples.

* **Recompute model** — vLLM's prefill cost per token grows with its position
  (attention): a forward step over requests scheduling ``m`` tokens from
  position ``p`` costs ``c0 + c1·Σm + c2·Σm·(p + m/2)``: ``c0`` the median of
  small (decode) steps, ``c1`` and ``c2`` a least-squares fit of recent prefill
  steps above it (each sample's weight halves every ``half_life`` seconds), so
  recomputing tokens ``[a, b)`` costs ``c1·(b-a) + c2·(b-a)·(a + (b-a)/2)``.
* **Load model** — a load of ``t`` tokens costs ``l0 + t/rate`` (fitted over recent
  loads' transfer times, measured on the worker) times how much slower than that the
  last :data:`RECENT` loads were, counting the tokens already being loaded ahead of
  it (one loader per worker) and, for a background load, one engine step until vLLM
  schedules it.
* **Decision** — among prefixes of the hit (every chunk boundary, coarsened to at
  most :data:`CANDIDATES`), claim the one that saves the most time, and only if
  its load costs at most ``(1 - margin)`` of what recomputing it would. Without
  enough samples (three loads, two prefill steps) the claim is made (the pool is assumed to pay
  until measured; with CUDA KV a probe at start supplies the first load samples,
  :mod:`~mooncake_vllm.store.probe`). A prompt reaching further than any prefill step measured is
  weighed against a *floor* of its recompute (attention makes recompute grow
  faster than linearly, so each token past the reach costs at least what the
  token at the reach did): a load that beats the floor is claimed; one that
  does not is declined once (``reach_probe``), so vLLM recomputes it and the
  model learns that far. While claims are declined, the pool is measured again every
  ``explore_every`` seconds, so a pool that recovers is noticed: by a background probe
  of throw-away loads where the workers run one (CUDA KV, :meth:`ClaimAdvisor.take_probe`),
  else by claiming a quarter of one hit long enough for that to be cheap
  (``explore``, :data:`EXPLORE_STEPS`). Blind claims (prefills unmeasured, loads measured)
  do not queue: while one load is in flight, a long enough hit is recomputed instead
  (``measure_probe``), which measures prefills. An engine that never prefills (every
  prompt a hit) would stay unmeasured: after :data:`MEASURE_AFTER` unmeasured claims, the
  last :data:`MIN_FIT` tokens of a long enough hit are recomputed once in a while (the rest
  claimed) until the recompute model has samples.

``policy``: ``auto`` (the above), ``always`` (every hit), ``never`` (none).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mooncake_vllm.v1.claim_models import MIN_FIT, OUTLIER, LoadModel, PrefillModel

__all__ = ["CANDIDATES", "DECLINE_REASONS", "ELAPSED_WINDOW", "MEASURE_AFTER", "MIN_FIT", "OUTLIER", "ClaimAdvisor",
           "ClaimRules", "Decision", "LoadModel", "PrefillModel"]

#: prefix lengths a decision weighs (chunk boundaries, evenly coarsened)
CANDIDATES = 16
#: decisions kept for :meth:`ClaimAdvisor.snapshot`
_DECISIONS_KEPT = 256
#: a declined hit is explored only if recomputing it costs at least this many engine steps
EXPLORE_STEPS = 4.0
#: unmeasured claims after which, the loads being measured, a hit of at least :data:`MIN_FIT`
#: tokens is recomputed (``measure_probe``, at most one per ``explore_every``) until the
#: recompute model has its samples: an engine whose every prompt hits the pool or its own
#: prefix cache never prefills otherwise, and would claim every hit, paying or not, for ever
MEASURE_AFTER = 8
#: claimed background loads whose time from the claim to the step that reported them over is
#: kept (what a load costs as vLLM's scheduler sees it: the transfer and the steps around it)
ELAPSED_WINDOW = 16
#: a decision's reasons for claiming less than the hit (the scheduler counts each as
#: ``claims_declined_<reason>``)
DECLINE_REASONS = ("slow_pool", "never", "reach_probe", "measure_probe")


@dataclass(frozen=True)
class ClaimRules:
    """The policy's knobs; immutable, like urllib3's ``Retry``."""

    policy: str = "auto"
    #: claim when the load costs at most (1 - margin) of the recompute it replaces
    margin: float = 0.1
    #: seconds after which a sample counts half
    half_life: float = 60.0
    #: while declining, let one claim through this often (seconds) to measure the pool again
    explore_every: float = 5.0
    #: loads (and claimed loads' elapsed times) the load model needs before it decides anything
    min_samples: int = 3
    #: prefill steps the recompute model needs: two fit it (``c1``, ``c2`` over the decodes'
    #: ``c0``), and a third that lies is caught as an outlier against them. With three, the
    #: H100's fresh reader of 2026-12-06 warmed up with a 1k and a 2k prefill claimed its 2k
    #: hits blind at 1.43x their recompute; its two priced them at ~36 ms against a ~39 ms load
    min_prefills: int = 2

    def __post_init__(self) -> None:
        if self.policy not in ("auto", "always", "never"):
            raise ValueError(f"load_policy: found {self.policy!r}, use auto, always or never")
        if self.min_prefills < 2:
            raise ValueError(f"min_prefills: found {self.min_prefills}, the recompute fit needs at least 2")


@dataclass(frozen=True)
class Decision:
    """How many of the hit's tokens to claim, and why."""

    tokens: int
    reason: str  #: claimed | unmeasured | measure_probe | explore | always | slow_pool | reach_probe | never
    predicted_load: float = math.nan  #: seconds, for the claimed (or best) prefix
    predicted_recompute: float = math.nan


class ClaimAdvisor:
    """Decides claims from the models; counts every decision by reason."""

    def __init__(self, rules: ClaimRules, *, clock: Callable[[], float] = time.monotonic,
                 background: bool = True) -> None:
        self.rules = rules
        self.clock = clock
        self.background = background
        self.prefill = PrefillModel(rules.half_life)
        self.loads = LoadModel(rules.half_life)
        self._last_explore = -math.inf
        #: when a hit worth exploring was last declined (``slow_pool``): a probe is wanted after it
        self._declined_at = -math.inf
        #: the workers measure the pool with throw-away loads when asked (:meth:`take_probe`),
        #: so a declining policy explores without claiming part of a request's hit
        self.probes_available = False
        self._last_measure = -math.inf
        #: ``(tokens, seconds)`` of claimed background loads, from claim to reported over
        self.elapsed: deque[tuple[float, float]] = deque(maxlen=ELAPSED_WINDOW)
        self.counts: dict[str, int] = {}
        #: the last decisions: ``(clock, start, hit, decision)`` (what an operator or a bench
        #: compares with what the requests then took)
        self.recent: deque[tuple[float, int, int, Decision]] = deque(maxlen=_DECISIONS_KEPT)

    def observe(self, steps: Iterable[Sequence[float]] = (),
                loads: Iterable[Sequence[float]] = (), probes: bool = False) -> None:
        """Worker measurements: steps ``(tokens, work[, reach], seconds)``, loads
        ``(tokens, seconds)``; ``probes``: the worker runs background probes when asked."""
        now = self.clock()
        self.probes_available = self.probes_available or probes
        for step in steps:
            tokens, work, *reach, seconds = step
            self.prefill.add(now, tokens, work, seconds, reach[0] if reach else 0.0)
        for tokens, seconds in loads:
            self.loads.add(now, tokens, seconds)

    def observe_elapsed(self, tokens: float, seconds: float) -> None:
        """A claimed background load of ``tokens`` was reported over ``seconds`` after its claim."""
        if tokens > 0 and seconds > 0:
            self.elapsed.append((float(tokens), float(seconds)))

    def wait(self, now: float, predict: Callable[[float], float] | None = None) -> float:
        """What a background load costs beyond its transfer: one engine step (vLLM schedules
        it at the next) until measured, then the median over recent claimed loads of their
        claim-to-reported-over seconds less their predicted transfer (the H200, 2026-12-05:
        TTFT of 8k-32k hits 54-101 ms over the transfer with 17 ms steps, where one step was
        assumed and an 8k hit claimed at a predicted 117 ms took 238 against 203 to recompute).
        The request's last step follows either way, as a recompute's prefill would.
        ``predict``: the load model's transfer predictor at ``now``, if the caller has it."""
        if not self.background:
            return 0.0
        predict = predict or self.loads.predictor(now)
        if predict is None or len(self.elapsed) < self.rules.min_samples:
            return self.prefill.step(now)
        extra = sorted(seconds - predict(tokens) for tokens, seconds in self.elapsed)
        return max(0.0, extra[len(extra) // 2])

    def decide(self, start: int, hit: int, chunk: int, backlog: int = 0,
               probe: bool = True) -> Decision:
        """Of ``hit`` tokens from position ``start`` (whole ``chunk``-token chunks), how many
        to claim; ``backlog``: tokens already being loaded ahead of this one; ``probe``:
        whether this hit may be recomputed to measure prefills (not a hand-off's decode,
        whose instance exists not to prefill: 1P1D on the CPU engine lost 3 of 24)."""
        d = self._decide(start, hit, chunk, backlog, probe)
        self.counts[d.reason] = self.counts.get(d.reason, 0) + 1
        self.recent.append((self.clock(), start, hit, d))
        return d

    def snapshot(self) -> dict[str, object]:
        """The models' state and the recent decisions, as plain data."""
        now = self.clock()
        return {"coefficients": self.prefill.coefficients(now), "reach": self.prefill.reach,
                "prefill_outliers": self.prefill.outliers,
                "prefill_samples": [[t, *x, y] for t, x, y in self.prefill.samples],
                "load_samples": [list(x) for x in self.loads.samples], "counts": dict(self.counts),
                "load_wait": self.wait(now), "elapsed": [list(x) for x in self.elapsed],
                "decisions": [[at, start, hit, d.tokens, d.reason, d.predicted_load,
                               d.predicted_recompute] for at, start, hit, d in self.recent]}

    def _decide(self, start: int, hit: int, chunk: int, backlog: int, probe: bool) -> Decision:
        policy = self.rules.policy
        if hit <= 0 or policy == "never":
            return Decision(0, "never" if hit > 0 else "claimed")
        if policy == "always":
            return Decision(hit, "always")
        now = self.clock()
        d = self._verdict(now, start, hit, chunk, backlog, probe)
        if d.reason == "explore":
            self._last_explore = now
        elif d.reason == "slow_pool" and self._worth_exploring(now, start, hit):
            self._declined_at = now  # a hit long enough to pay once the pool recovers
        elif d.reason == "measure_probe":
            self._last_measure = now
        return d

    def _verdict(self, now: float, start: int, hit: int, chunk: int, backlog: int,
                 probe: bool = False) -> Decision:
        """``auto``'s decision, nothing recorded; ``probe``: a measure probe may be it."""
        best = self._best(now, start, hit, chunk, backlog)
        if best is None:
            return Decision(self._measuring_claim(hit, chunk, backlog), "measure_probe") \
                if probe and self._measure_due(now, hit, backlog) else Decision(hit, "unmeasured")
        tokens, load, recompute = best
        if tokens > 0 and load <= (1.0 - self.rules.margin) * recompute:
            return Decision(tokens, "claimed", load, recompute)
        if self.prefill.reaches_past(start + hit):
            # only a floor of the recompute was known: recompute once, to measure that far
            return Decision(0, "reach_probe", load, recompute)
        if self._explore_due(now, start, hit):  # a quarter of the hit measures the pool at a quarter of the risk
            quarter = min(hit, max(chunk, (hit // 4) // max(1, chunk) * chunk))
            return Decision(quarter, "explore", load, recompute)
        return Decision(0, "slow_pool", load, recompute)

    def declines_any_hit(self, start: int, hit: int, chunk: int, backlog: int = 0) -> bool:
        """Whether no hit of up to ``hit`` tokens from ``start`` would be claimed now, so the
        pool need not be asked (nothing is recorded). Loads cost ``l0 + t/rate`` (both
        non-negative) and recomputing ``t`` tokens grows at least linearly, so the
        load-to-recompute ratio falls with ``t``: if the whole hit does not pay, no part
        does. ``False`` whenever a decision could claim: unmeasured, beyond the measured
        reach (a shorter hit may lie within it), an explore due, a policy other than ``auto``."""
        if self.rules.policy != "auto" or hit <= 0 or self.prefill.reaches_past(start + hit):
            return False
        return self._verdict(self.clock(), start, hit, chunk, backlog).tokens == 0

    def note_declined(self, start: int, hit: int) -> None:
        """A hit of ``hit`` tokens from ``start`` was declined without a decision (its lookup
        skipped: :meth:`declines_any_hit`), found later: as :meth:`decide`'s ``slow_pool``,
        a probe is wanted after it when it is worth exploring."""
        now = self.clock()
        self.counts["slow_pool_unasked"] = self.counts.get("slow_pool_unasked", 0) + 1
        if self.rules.policy == "auto" and self._worth_exploring(now, start, hit):
            self._declined_at = now

    def take_probe(self) -> bool:
        """Whether the workers should measure the pool now with a background probe (and, if
        so, it is counted as done): ``auto`` has declined a hit worth exploring (one whose
        recompute costs :data:`EXPLORE_STEPS` engine steps: a short span never pays, however
        fast the pool) since the last probe or load, and ``explore_every`` s have passed.
        Where the workers can probe (:attr:`probes_available`), this replaces the quarter-hit
        ``explore``, which made the request it explored with slower than its recompute (the
        H100, 2026-12-05: an 8k hit whose quarter was claimed took 259 ms against 211)."""
        now = self.clock()
        if (self.rules.policy != "auto" or not self.probes_available
                or self._declined_at <= self._last_measured() or not self._exploring_due(now)):
            return False
        self._last_explore = now
        self.counts["background_probe"] = self.counts.get("background_probe", 0) + 1
        return True

    def _measure_due(self, now: float, hit: int, backlog: int = 0) -> bool:
        """Recompute this hit to measure prefills: the loads are measured and the prefills
        are not, the hit is long enough to be a sample, and either another load is in
        flight (``backlog``: a second blind claim would only queue behind it — on the H100
        a fresh engine's 8 blind 2k claims of one burst were reported over 75-630 ms after
        their claims, one loader taking them in turn, where each recompute took ~50), or
        :data:`MEASURE_AFTER` unmeasured claims were made (a fresh engine's first hits stay
        claimed), at most one per ``explore_every``."""
        prefills_unmeasured = not self._prefills_measured(now)
        if not (prefills_unmeasured and hit >= MIN_FIT
                and len(self.loads.samples) >= self.rules.min_samples):
            return False
        return backlog > 0 or (self.counts.get("unmeasured", 0) >= MEASURE_AFTER
                               and now - self._last_measure >= self.rules.explore_every)

    def _measuring_claim(self, hit: int, chunk: int, backlog: int) -> int:
        """Of a measure probe's hit, what is still claimed: with a load in flight nothing (a
        claim would queue behind it); else all but the last :data:`MIN_FIT` tokens or more
        (whole chunks), so vLLM computes one step long enough to be a prefill sample, deep in
        the prompt, instead of the whole hit (the dev box, 2026-12-05: an engine that only hit
        the pool recomputed its ninth hit, 8k tokens, in 7.3 s where the load took 0.24).
        Synchronous loads run inside the step that computes the tail, so that step would
        time the load too: there the whole hit is recomputed."""
        if backlog > 0 or not self.background:
            return 0
        return max(0, (hit - MIN_FIT) // max(1, chunk) * chunk)

    def _prefills_measured(self, now: float) -> bool:
        """Whether the recompute model has its :attr:`ClaimRules.min_prefills` samples and a fit."""
        return (len(self.prefill.samples) >= self.rules.min_prefills
                and self.prefill.coefficients(now) is not None)

    def _last_measured(self) -> float:
        """When the pool was last measured: an explore or probe asked for, or a load's sample."""
        return max(self._last_explore, self.loads.last_sample)

    def _exploring_due(self, now: float) -> bool:
        """``explore_every`` s have passed since the pool was last measured."""
        return now - self._last_measured() >= self.rules.explore_every

    def _explore_due(self, now: float, start: int, hit: int) -> bool:
        return (not self.probes_available and self._exploring_due(now)
                and self._worth_exploring(now, start, hit))

    def _worth_exploring(self, now: float, start: int, hit: int) -> bool:
        """A hit whose whole recompute costs at least :data:`EXPLORE_STEPS` engine steps:
        on a shorter one a quarter-hit load costs about what the whole recompute does (the
        H200's 2k hits: 49 ms to recompute, 2.4 steps; the exploring quarter took 102 ms)."""
        recompute = self.prefill.recompute_floor(now, start, start + hit)
        return recompute is not None and recompute >= EXPLORE_STEPS * self.prefill.step(now)

    def _best(self, now: float, start: int, hit: int, chunk: int,
              backlog: int) -> tuple[int, float, float] | None:
        """The prefix that saves the most: ``(tokens, load s, recompute s)``; ``None`` unmeasured."""
        if len(self.loads.samples) < self.rules.min_samples or not self._prefills_measured(now):
            return None  # one slow first load (a pool busy with the first saves) says little
        beyond = self.prefill.reaches_past(start + hit)
        recompute_of = self.prefill.recompute_floor if beyond else self.prefill.recompute
        chunks = max(1, hit // max(1, chunk))
        stride = max(1, -(-chunks // CANDIDATES))
        lengths = sorted({min(chunks, k) * chunk for k in range(stride, chunks + stride, stride)})
        load_seconds = self.loads.predictor(now)
        if load_seconds is None:
            return None
        wait = self.wait(now, load_seconds)
        best: tuple[float, int, float, float] | None = None
        for tokens in lengths:
            recompute = recompute_of(now, start, start + tokens)
            if recompute is None:
                return None
            load = load_seconds(backlog + tokens) + wait
            saving = recompute - load
            if best is None or saving > best[0]:
                best = (saving, tokens, load, recompute)
        assert best is not None
        return best[1], best[2], best[3]
