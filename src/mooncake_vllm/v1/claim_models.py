"""The claim policy's two models, fitted online from what the workers measure.

* :class:`PrefillModel` — seconds of a prefill step from its work: ``c0 + c1·Σm +
  c2·Σm·(p + m/2)`` (:mod:`~mooncake_vllm.v1.claims` explains the terms).
* :class:`LoadModel` — seconds of a load: a shape ``l0 + tokens/rate`` times how much
  slower than it the last :data:`RECENT` loads were.

Pure logic over samples and times, testable with made-up numbers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["MAX_OUTLIERS", "MIN_FIT", "MIN_PREFILL", "OUTLIER", "REACH_MARGIN", "RECENT", "LoadModel",
           "PrefillModel"]

_WINDOW = 256  #: prefill samples kept
#: loads the load model's shape is fitted to
_LOAD_WINDOW = 32
#: recent loads that say how much slower (or faster) the pool is now than its shape
RECENT = 3
#: steps scheduling fewer tokens are decodes: their median is the fixed cost of a step
MIN_PREFILL = 64
#: the fewest tokens a step must schedule to teach the per-token costs. Below this a step's
#: time is its fixed cost and noise (on an H200 a 64-token prefill took 16-41 ms, a decode
#: 19 ms: three of them fitted 210 us/token, 10x the truth, and every 2k hit was claimed)
MIN_FIT = 512
#: beyond this multiple of the furthest position measured, only a floor of recompute is trusted
REACH_MARGIN = 1.25
#: a prefill step this many times slower than the model predicts is left out of the fit (the
#: H200 of 2026-12-05 12:00: a fresh reader's first 4k prefill, 298 ms, was 2.98x what its 1k and
#: 2k prefills predicted with no decode measured yet; fitted, it priced an 8k recompute at 0.75 s
#: against 0.2 s real, and an 8k hit that did not pay was claimed: 250 ms against 205)
OUTLIER = 2.5
#: ... but no more than this many in a row
MAX_OUTLIERS = 2


def _decayed_fit(rows: Sequence[tuple[float, Sequence[float], float]], now: float,
                 half_life: float) -> list[float] | None:
    """Weighted least squares ``y ~ x·coef`` (rows: time, x, y); ``None`` if singular."""
    n = len(rows[0][1]) if rows else 0
    ata = [[0.0] * n for _ in range(n)]
    aty = [0.0] * n
    for at, x, y in rows:
        w = 0.5 ** (max(0.0, now - at) / half_life)
        for i in range(n):
            aty[i] += w * x[i] * y
            for j in range(n):
                ata[i][j] += w * x[i] * x[j]
    for i in range(n):  # a whisper of ridge: tiny, collinear samples stay solvable
        ata[i][i] += 1e-12 * (ata[i][i] + 1.0)
    return _solve(ata, aty)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [vr - f * vc for vr, vc in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nonnegative_fit(rows: Sequence[tuple[float, Sequence[float], float]], now: float,
                     half_life: float) -> list[float] | None:
    """``[c1, c2] >= 0`` of ``y ~ c1·Σm + c2·Σm(p + m/2)``; ``None`` if nothing fits.

    Both columns are fitted only where the samples tell them apart: their mean position
    ``work / tokens`` must vary (prefills of one size from position 0 all lie on one line
    through the origin, and a least-squares solution of such rows is any point of it: on
    the H200 three 2k warm-up prompts gave a 1k recompute of 0.3 ms). Otherwise, or when one
    coefficient comes out negative, the other column alone is fitted."""
    spread = [x[1] / x[0] for _, x, _ in rows if x[0] > 0]
    both = bool(spread) and max(spread) >= 1.5 * min(spread)
    coef = _decayed_fit(rows, now, half_life) if both else None
    if coef is not None and coef[0] >= 0 and coef[1] >= 0:
        return coef
    # no curvature in the data (or none measurable): linear in tokens; a negative per-token
    # cost (strong curvature): all of it attention work
    column = 1 if coef is not None and coef[0] < 0 else 0
    one = _decayed_fit([(t, x[column:column + 1], y) for t, x, y in rows], now, half_life)
    if one is None or one[0] < 0:
        return None
    return [0.0, one[0]] if column else [one[0], 0.0]


class PrefillModel:
    """Seconds of a prefill step from its work (``Σm``, ``Σm·(p + m/2)``), fitted online.

    The fixed cost of a step, ``c0``, is the median of the steps scheduling fewer than
    :data:`MIN_PREFILL` tokens (decodes: plenty of them); ``c1`` and ``c2`` are fitted
    to the time above ``c0`` of prefill steps of at least :data:`MIN_FIT` tokens. Fitting
    all three to prefill steps alone is ill-posed when they are all one chunk size (vLLM
    splits long prompts into ``max_num_batched_tokens`` chunks): the intercept then soaks
    up the per-token cost. ``reach`` is the furthest position a prefill step computed:
    well past it (:meth:`reaches_past`) only :meth:`recompute_floor` is trusted.
    """

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self.samples: deque[tuple[float, tuple[float, float], float]] = deque(maxlen=_WINDOW)
        self._small: deque[float] = deque(maxlen=_WINDOW)
        self._reach: deque[float] = deque(maxlen=_WINDOW)
        self._coef: list[float] | None = None
        self._fitted_at = -math.inf
        self.outliers = 0  #: prefill steps left out as outliers (:meth:`_outlier`)
        self._in_a_row = 0

    @property
    def reach(self) -> float:
        return max(self._reach, default=0.0)

    def add(self, now: float, tokens: float, work: float, seconds: float,
            reach: float = 0.0) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        if tokens < MIN_PREFILL:
            self._small.append(float(seconds))
        elif tokens >= MIN_FIT:
            if self._outlier(now, tokens, work, seconds):
                return
            self.samples.append((now, (float(tokens), float(work)), float(seconds)))
            self._reach.append(float(reach or tokens))
        self._coef = None

    def _outlier(self, now: float, tokens: float, work: float, seconds: float) -> bool:
        """A step over :data:`OUTLIER` times what the model predicts for it: a first-time
        shape (allocations, kernel selection), not the cost of its tokens — on the H200 a
        fresh engine's first 4k prefill took 382 ms against ~90 ms, and a fit over it priced
        every 2k hit above its load. Left out, at most :data:`MAX_OUTLIERS` in a row (then
        the model is what is wrong), and counted."""
        coef = self.coefficients(now)
        if coef is None:
            return False
        c0, c1, c2 = coef
        expected = c1 * tokens + c2 * work
        if expected > 0 and seconds - c0 > OUTLIER * expected and self._in_a_row < MAX_OUTLIERS:
            self._in_a_row += 1
            self.outliers += 1
            return True
        self._in_a_row = 0
        return False

    def reaches_past(self, end: int) -> bool:
        """Whether position ``end`` lies past :data:`REACH_MARGIN` times the reach."""
        return end > REACH_MARGIN * self.reach

    def fixed(self) -> float:
        """``c0``: the median small step (0 before one is measured)."""
        small = sorted(self._small)
        return small[len(small) // 2] if small else 0.0

    def coefficients(self, now: float) -> tuple[float, float, float] | None:
        """``(c0, c1, c2)`` with ``c1, c2 >= 0``, or ``None`` before enough samples."""
        if len(self.samples) < 2:
            return None
        if self._coef is None or now - self._fitted_at > self.half_life / 8:
            c0 = self.fixed()
            rows = [(t, x, max(0.0, y - c0)) for t, x, y in self.samples]
            coef = _nonnegative_fit(rows, now, self.half_life)
            if coef is None:
                return None
            self._coef, self._fitted_at = [c0, *coef], now
        c0, c1, c2 = self._coef
        return c0, c1, c2

    def recompute(self, now: float, start: int, end: int) -> float | None:
        """Seconds to prefill positions ``[start, end)`` (``None``: not measured yet)."""
        coef = self.coefficients(now)
        if coef is None:
            return None
        _, c1, c2 = coef
        n = end - start
        return c1 * n + c2 * n * (start + n / 2)

    def recompute_floor(self, now: float, start: int, end: int) -> float | None:
        """A lower bound of :meth:`recompute` that holds past the reach: the fitted cost
        up to the reach, then every further token at the cost of the token at the reach
        (a token's cost only grows with its position)."""
        coef = self.coefficients(now)
        if coef is None:
            return None
        _, c1, c2 = coef
        reach = max(float(start), min(float(end), self.reach))
        within = c1 * (reach - start) + c2 * (reach - start) * (start + (reach - start) / 2)
        return within + (end - reach) * (c1 + c2 * reach)

    def step(self, now: float) -> float:
        """The fixed cost of one engine step (seconds; 0 before it is measured)."""
        return self.fixed()


class LoadModel:
    """Seconds of a load: a shape ``l0 + tokens/rate`` fitted over the last
    :data:`_LOAD_WINDOW` loads, times how much slower than that shape the last
    :data:`RECENT` loads were (their median ratio).

    The shape knows that a small load costs more per token than a large one (a
    quarter-hit probe says little about a whole hit per token); the recent factor
    makes a pool that slows down (a busy holder, a degraded link) show in two loads,
    and one that recovers in two probes, while one outlier moves nothing."""

    def __init__(self, half_life: float = 60.0) -> None:
        self.half_life = half_life
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=_LOAD_WINDOW)
        self.last_sample = -math.inf

    def add(self, now: float, tokens: float, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.samples.append((now, float(tokens), float(seconds)))
            self.last_sample = now

    def _shape(self, now: float) -> tuple[float, float]:
        """``(l0, seconds per token)`` of the window (``l0`` 0 unless sizes vary)."""
        rows = list(self.samples)
        sizes = [t for _, t, _ in rows]
        if max(sizes) >= 1.5 * min(sizes):
            coef = _decayed_fit([(at, (1.0, t), y) for at, t, y in rows], now, self.half_life)
            if coef is not None and coef[0] >= 0 and coef[1] > 0:
                return coef[0], coef[1]
        num = den = 0.0
        for at, t, y in rows:
            w = 0.5 ** (max(0.0, now - at) / self.half_life)
            num, den = num + w * y, den + w * t
        return 0.0, num / den

    def predictor(self, now: float) -> Callable[[float], float] | None:
        """Seconds to load a number of tokens, as of ``now`` (``None``: not measured yet);
        fitted once, for a decision that weighs several prefixes."""
        if not self.samples:
            return None
        l0, per_token = self._shape(now)
        ratios = sorted(y / (l0 + t * per_token) for _, t, y in list(self.samples)[-RECENT:])
        mid = len(ratios) // 2
        factor = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
        return lambda tokens: factor * (l0 + tokens * per_token)

    def seconds(self, tokens: float, now: float | None = None) -> float | None:
        """Predicted seconds to load ``tokens`` (``None``: not measured yet)."""
        predict = self.predictor(self.last_sample if now is None else now)
        return None if predict is None else predict(tokens)
