"""The scheduler's side of the claim policy: chunk spans in, tokens claimed out, every decline
counted and logged (rate-limited).

:class:`~mooncake_vllm.v1.claims.ClaimAdvisor` decides in tokens from what the workers measured;
this turns a lookup's chunks into its questions and its answers into the scheduler's counters
(``claims_declined_<reason>``, ``declined_tokens``, ``claim_probes``,
``lookups_skipped_slow_pool``) and one warning per reason a minute.
"""

from __future__ import annotations

from mooncake_vllm.stats import Counters
from mooncake_vllm.store.health import FailureLog
from mooncake_vllm.v1.claims import DECLINE_REASONS, ClaimAdvisor

__all__ = ["ClaimGate"]

_HOW_TO_FIX = ("(more holders and store_clients make it faster; load_policy always claims "
               "regardless)")


class ClaimGate:
    """What a request's chunks ``[start, start + n)`` claim, for one scheduler."""

    def __init__(self, advisor: ClaimAdvisor, counters: Counters, block_size: int) -> None:
        self.advisor = advisor
        self.counters = counters
        self.block_size = block_size
        self._log = FailureLog()

    def declines_every_hit(self, start: int, chunks: int, backlog: int) -> bool:
        """Whether even a hit of all ``chunks`` would be declined: then vLLM's thread does not
        look them up (counted as ``lookups_skipped_slow_pool``)."""
        bs = self.block_size
        if not self.advisor.declines_any_hit(start * bs, chunks * bs, bs, backlog):
            return False
        self.counters["lookups_skipped_slow_pool"] += 1
        self._log.warn("slow_pool", (
            f"mooncake-vllm: pool claims declined (load_policy auto): even a hit of all "
            f"{chunks * bs} tokens would load slower than vLLM recomputes them, so vLLM's thread "
            "does not ask the pool and vLLM recomputes; the pool is measured again every "
            f"{self.advisor.rules.explore_every:.0f} s on hits long enough to pay {_HOW_TO_FIX}"))
        return True

    def declined_unasked(self, start: int, hits: int) -> None:
        """A span not looked up turned out to hold ``hits`` leading chunks from ``start``: a hit
        declined (counted; the advisor is told, so it measures the pool again)."""
        if hits <= 0:
            return
        bs = self.block_size
        self.counters["claims_declined_slow_pool"] += 1
        self.counters["declined_tokens"] += hits * bs
        self.advisor.note_declined(start * bs, hits * bs)

    def claim(self, start: int, hits: int, backlog: int, probe: bool = True) -> int:
        """How many of ``hits`` chunks from chunk ``start`` to claim; a hand-off's decode is
        never the one recomputed to measure prefills (``probe``)."""
        bs = self.block_size
        decision = self.advisor.decide(start * bs, hits * bs, bs, backlog, probe=probe)
        if decision.reason == "explore":
            self.counters["claim_probes"] += 1
        declined = hits - decision.tokens // bs
        if declined > 0 and decision.reason in DECLINE_REASONS:
            self.counters[f"claims_declined_{decision.reason}"] += 1
            self.counters["declined_tokens"] += declined * bs
            if decision.reason == "slow_pool":
                self._log.warn("slow_pool", (
                    f"mooncake-vllm: pool claims declined (load_policy auto): loading "
                    f"{hits * bs} tokens was predicted at {decision.predicted_load:.3f} s against "
                    f"{decision.predicted_recompute:.3f} s to recompute them, so vLLM recomputes; "
                    f"the pool is measured again every {self.advisor.rules.explore_every:.0f} s "
                    f"{_HOW_TO_FIX}"))
        return decision.tokens // bs
