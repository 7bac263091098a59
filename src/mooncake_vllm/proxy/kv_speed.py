"""How fast each instance prefills, measured from its engine's own counters (``kv_aware``'s cost model).

Instances of one fleet need not be equally fast: other hardware, another tenant on the host,
or (the 2-core CPU bench) two instances computing on one core while a third has the other to
itself. ``kv_aware`` weighs each instance's expected work by its measured speed: expected TTFT
= (queued work + the prompt's own work) / its rate.

The rate is the prefill tokens an engine computed (``vllm:request_prefill_kv_computed_tokens``,
cached ones excluded) per second its requests spent in prefill (``vllm:request_prefill_time_seconds``),
both histogram sums read by :mod:`.engine_load`. The engine's totals since it started seed it (a
fresh proxy knows each instance's speed before its first request), capped at ``horizon`` tokens so
that what it computes from then on soon outweighs them; each later answer's increase is added, the
older sums decayed by ``exp(-tokens / horizon)``. Concurrent prefills share an engine's steps, so the
rate is per request at the concurrency it ran, alike for all instances under a similar load.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

__all__ = ["SpeedTracker"]

log = logging.getLogger(__name__)


class SpeedTracker:
    """Per-instance prefill rate (tokens/s) and each candidate's speed relative to the others."""

    def __init__(self, horizon: float = 16384.0, min_tokens: float = 2048.0, clamp: float = 4.0) -> None:
        self.horizon = horizon
        self.min_tokens = min_tokens  # fewer measured tokens than this: the rate is not trusted yet
        self.clamp = clamp  # a relative speed stays within [1/clamp, clamp]
        self._sums: dict[str, tuple[float, float]] = {}  # instance -> decayed (tokens, seconds)
        self._last: dict[str, tuple[float, float]] = {}  # instance -> the engine's totals last read

    def update(self, key: str, tokens: float, seconds: float) -> None:
        """One answer of ``key``'s engine: its prefill tokens and seconds since it started."""
        if tokens <= 0 or seconds <= 0:
            return  # the engine reports neither (another release) or has prefilled nothing yet
        last = self._last.get(key)
        self._last[key] = (tokens, seconds)
        if last is None or tokens < last[0] or seconds < last[1]:  # first answer, or a restarted engine
            cap = min(1.0, self.horizon / tokens)
            self._sums[key] = (tokens * cap, seconds * cap)
            return
        d_tokens, d_seconds = tokens - last[0], seconds - last[1]
        if d_tokens <= 0 or d_seconds <= 0:
            return
        old = self._sums.get(key, (0.0, 0.0))
        keep = math.exp(-d_tokens / self.horizon)
        self._sums[key] = (keep * old[0] + d_tokens, keep * old[1] + d_seconds)

    def rate(self, key: str) -> float | None:
        """``key``'s prefill tokens per second; None until ``min_tokens`` were measured."""
        tokens, seconds = self._sums.get(key, (0.0, 0.0))
        return tokens / seconds if tokens >= self.min_tokens and seconds > 0 else None

    def relative(self, keys: Sequence[str]) -> list[float]:
        """Each instance's rate over the geometric mean of the measured ones among ``keys``
        (1.0 for one not measured yet), within ``[1/clamp, clamp]``."""
        rates = [self.rate(k) for k in keys]
        known = [r for r in rates if r is not None]
        if not known:
            return [1.0] * len(keys)
        mean = math.exp(sum(math.log(r) for r in known) / len(known))
        return [1.0 if r is None else min(self.clamp, max(1.0 / self.clamp, r / mean)) for r in rates]

    def forget(self, key: str) -> None:
        """``key`` left rotation: measure it afresh when it is back."""
        self._sums.pop(key, None)
        self._last.pop(key, None)

    def render(self) -> list[str]:
        """``mooncake_proxy_kv_aware_prefill_rate`` gauge lines (tokens/s) of the measured instances."""
        out = ["# TYPE mooncake_proxy_kv_aware_prefill_rate gauge"]
        out += [f'mooncake_proxy_kv_aware_prefill_rate{{instance="{k}"}} {r:.1f}'
                for k in sorted(self._sums) if (r := self.rate(k)) is not None]
        return out
