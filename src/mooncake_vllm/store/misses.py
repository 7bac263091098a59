"""Misses caused by an error, counted by cause, each cause logged with its fix.

A pool miss is normally the pool not having a block (never saved, evicted): nothing to
fix. A miss the pool *should* have served but could not — the master away (breaker
open), a lookup or a transfer past its deadline, a holder gone, a corrupt value, no
staging slot — is counted here as ``miss_<cause>`` in the client's
:class:`~mooncake_vllm.stats.StoreStats` (blocks), exported by the V1 connector as
``vllm:mooncake_vllm_miss_causes_total{cause}``, and logged at most once per cause per
interval (:class:`~mooncake_vllm.store.health.FailureLog`) with the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake_vllm.store.transport import Transport

__all__ = ["LOOKUP_CAUSES", "MISS_CAUSES", "MISS_PREFIX", "miss_counts", "missed"]

#: counter name prefix in StoreStats (``miss_<cause>``)
MISS_PREFIX = "miss_"
#: cause -> (what happened, the fix); the one home of both
MISS_CAUSES: Mapping[str, tuple[str, str]] = {
    "pool_away": ("a lookup answered 'miss' without asking: the pool is marked away "
                  "(circuit breaker open) after calls failed",
                  "check that mooncake_master at {master} runs and is reachable from this host; "
                  "misses stop once a probe finds it answering"),
    "breaker_open": ("a planned load was skipped: the pool is marked away (circuit "
                     "breaker open) after calls failed",
                     "check that mooncake_master at {master} runs and is reachable from this host; "
                     "misses stop once a probe finds it answering"),
    "lookup_failed": ("an existence query failed or passed its deadline",
                      "check the master's load and the link to {master}"),
    "load_timeout": ("a block transfer passed its deadline (a hung or overloaded holder, or a cut "
                     "link)", "check the holders' processes and the links to them; keep the pool "
                     "in several holders so one stall costs only its share"),
    "load_rejected": ("every transfer worker was still held by unanswered transfers",
                      "a holder stopped answering: find it (`mooncake-vllm pool stats`) and "
                      "restart it or its link"),
    "holder_suspended": ("the block lives in a holder that stopped answering (suspended after a "
                         "transfer passed its deadline; the other holders keep serving)",
                         "check that holder's process and link; its blocks load again once a "
                         "probe finds it answering"),
    "load_error": ("a get returned an error", "see the get failure lines for its code"),
    "lost_segment": ("the holder owning the block is gone (its values are lost until the master "
                     "expires it)", "restart that holder; keep several holders; a shorter "
                     "--client_ttl forgets a dead one sooner"),
    "corrupt": ("a stored value failed its header or checksum check",
                "nothing to do if rare (a raced save); if frequent, check the holders' memory"),
    "no_slot": ("no staging slot was free for the load",
                "raise staging (kv_connector_extra_config staging sizes) or lower concurrency"),
}


#: the causes a lookup (the scheduler side) counts; loads (the worker side) count the others
LOOKUP_CAUSES = ("pool_away", "lookup_failed")


def missed(transport: Transport, cause: str, blocks: int) -> None:
    """Count ``blocks`` misses caused by ``cause`` and log the cause (rate-limited) with its fix."""
    if blocks <= 0:
        return
    what, fix = MISS_CAUSES[cause]
    transport.stats.add(MISS_PREFIX + cause, blocks)
    master = transport.config.master_server_address
    transport.failures.warn(f"miss {cause}", f"mooncake-vllm: {blocks} pool miss(es) caused by "
                            f"{cause}: {what}. Fix: {fix.format(master=master)}", blocks)


def miss_counts(snapshot: Mapping[str, int]) -> dict[str, int]:
    """``{cause: blocks}`` from a StoreStats snapshot."""
    return {name[len(MISS_PREFIX):]: value for name, value in snapshot.items()
            if name.startswith(MISS_PREFIX) and name[len(MISS_PREFIX):] in MISS_CAUSES}
