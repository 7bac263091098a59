"""``kv_aware`` where this Python cannot run it: ``round_robin`` instead, said once and counted.

``kv_aware`` reads vLLM's KV events (pyzmq, msgspec: both come with vLLM, a proxy-only host
may lack them) and, with ``--tokenizer``, tokenizes prompts itself (transformers). Without
one of them the proxy still serves: it routes round robin, logs one warning naming the
packages, and counts every pick made so in ``mooncake_proxy_scheduling_fallback_total``
(:class:`Fallback`), so a default of ``kv_aware`` never stops a proxy from starting.
A ``--tokenizer`` directory that holds no tokenizer is still a start error (a typo, not a
missing package).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, replace
from typing import Any

from mooncake_vllm.proxy.kv_events import missing_modules

__all__ = ["FALLBACK_POLICY", "Fallback", "check"]

log = logging.getLogger(__name__)

#: what ``kv_aware`` falls back to
FALLBACK_POLICY = "round_robin"


@dataclass
class Fallback:
    """Why the configured policy is not the one routing, and how many picks it made instead."""

    wanted: str
    reason: str  # metric label: the missing packages, e.g. "missing_pyzmq_msgspec"
    picks: int = 0

    def render(self) -> str:
        """The ``mooncake_proxy_scheduling_fallback_total`` lines."""
        return ("# HELP mooncake_proxy_scheduling_fallback_total Picks made by round_robin because the "
                "configured policy cannot run here.\n# TYPE mooncake_proxy_scheduling_fallback_total counter\n"
                f'mooncake_proxy_scheduling_fallback_total{{wanted="{self.wanted}",using="{FALLBACK_POLICY}",'
                f'reason="{self.reason}"}} {self.picks}\n')


def _missing(config: Any) -> list[str]:
    """The packages (pip names) ``kv_aware`` would need here and cannot import."""
    missing = list(missing_modules())
    if config.tokenizer and importlib.util.find_spec("transformers") is None:
        missing.append("transformers")
    return missing


def check(config: Any) -> tuple[Any, Fallback | None]:
    """``config`` unchanged, or, for ``kv_aware`` without its packages, one that routes round
    robin (its kv_aware-only settings off) and the :class:`Fallback` to count; warns once."""
    if config.scheduling != "kv_aware" or not (missing := _missing(config)):
        return config, None
    log.warning("--scheduling kv_aware needs %s, which this Python cannot import: routing %s instead "
                "(pip install %s to route by KV; counted in mooncake_proxy_scheduling_fallback_total)",
                " and ".join(missing), FALLBACK_POLICY, " ".join(missing))
    fallback = Fallback("kv_aware", "missing_" + "_".join(missing))
    return replace(config, scheduling=FALLBACK_POLICY, tokenizer=None, kv_queue_cap=0), fallback
