"""Fixes for vLLM bugs that break a recipe this project documents, applied at plugin load
only on the releases the facts table says have them (never when the plugin is disabled).

* ``multi_prom_asserts_children``: vLLM's ``MultiConnector`` Prometheus metrics assert that
  every child reporting stats registered metrics of its own. The P2P ``MooncakeConnector``
  reports transfer stats and registers none, so the seed's MultiConnector(P2P + store) recipe
  answers 500 from the prefill's first transfer on (seen on the H200, vLLM 0.24.0). vLLM
  0.33 skips such children; :func:`skip_unregistered_prom_children` makes the older class
  do the same (their stats still go to vLLM's log line, not to Prometheus).
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

from mooncake_vllm.compat.versions import VllmFacts

__all__ = ["MULTI_MODULE", "apply", "skip_unregistered_prom_children"]

log = logging.getLogger(__name__)

MULTI_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
_MARK = "_mooncake_vllm_skips_unregistered"


def skip_unregistered_prom_children(cls: Any) -> bool:
    """Make ``cls.observe`` (a ``MultiKVConnectorPromMetrics``) pass on only the stats of
    children that registered Prometheus metrics; True if it was patched now."""
    original = getattr(cls, "observe", None)
    if original is None or getattr(original, _MARK, False):
        return False
    told: set[str] = set()

    @functools.wraps(original)  # __wrapped__: vLLM's own, for tests
    def observe(self: Any, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        known = getattr(self, "_prom_metrics", {})
        kept = {k: v for k, v in transfer_stats_data.items() if k in known}
        for name in set(transfer_stats_data) - set(kept) - told:
            told.add(name)
            log.info("mooncake-vllm: %s reports KV transfer stats but has no Prometheus metrics; "
                     "they are left out of /metrics (this vLLM's MultiConnector would stop serving "
                     "on them; vLLM 0.33 skips them the same way)", name)
        original(self, kept, engine_idx)

    setattr(observe, _MARK, True)
    cls.observe = observe
    return True


def apply(facts: VllmFacts) -> list[str]:
    """Apply the fixes ``facts`` call for; the names of those applied. Never raises."""
    applied = []
    if facts.multi_prom_asserts_children:
        try:
            cls = getattr(importlib.import_module(MULTI_MODULE), "MultiKVConnectorPromMetrics", None)
            if cls is not None and skip_unregistered_prom_children(cls):
                applied.append("multi_prom_asserts_children")
        except Exception:  # noqa: BLE001 - a fix must never break vLLM start-up
            log.warning("mooncake-vllm: could not apply the MultiConnector metrics fix", exc_info=True)
    return applied
