"""``MooncakeStoreConnector`` for the vLLM V1 engine (``KVConnectorBase_V1``).

Select it with::

    --kv-transfer-config '{"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}'

(after ``pip install mooncake-vllm`` the ``vllm.general_plugins`` entry point makes
the name resolve to this class), or explicitly with
``"kv_connector_module_path": "mooncake_vllm.v1.connector"``. To keep vLLM's
in-tree class of the same name (vLLM >= 0.21) set ``MOONCAKE_VLLM_DISABLE=1``
(the plugin then leaves the name alone). The Mooncake
settings come from ``$MOONCAKE_CONFIG_PATH`` (both the V0 and the V1 JSON shapes,
``"global_segment_size": "0"`` included). Private settings go in
``kv_connector_extra_config`` (validated once into
:class:`~mooncake_vllm.settings.ConnectorSettings`, the keys are listed there).
A ``tenant_id`` in the Mooncake config joins the key namespace.

The pool's threads (save, load, Mooncake's client threads) run off vLLM's CPU
compute cores, or below vLLM's priority where they share its cores
(:mod:`~mooncake_vllm.placement`; ``MOONCAKE_VLLM_THREAD_AFFINITY=off`` leaves
both alone, ``MOONCAKE_VLLM_THREAD_NICE`` sets how far below).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from mooncake_vllm import __version__
from mooncake_vllm.compat.facts import installed_facts
from mooncake_vllm.config import load_store_config
from mooncake_vllm.errors import UnsupportedVersionError
from mooncake_vllm.logs import follow_vllm_logging
from mooncake_vllm.placement import note_compute_cores, thread_affinity, thread_nice
from mooncake_vllm.settings import ConnectorSettings
from mooncake_vllm.store.namespaces import clear_namespaces, register_namespaces
from mooncake_vllm.v1.audits import AuditLane
from mooncake_vllm.v1.claims import ClaimAdvisor, ClaimRules
from mooncake_vllm.v1.client import SharedClient, shared_client
from mooncake_vllm.v1.handoff import MarkerWaiter, pool_ready, store_probe
from mooncake_vllm.v1.kv_groups import check_kv_cache_config, check_kv_caches
from mooncake_vllm.v1.metadata import MooncakeConnectorMetadata
from mooncake_vllm.v1.metrics import PoolStats, build_prom_metrics
from mooncake_vllm.v1.namespace import expected_layout, rank_namespaces
from mooncake_vllm.v1.nesting import adopt_failure_policy, check_stats_name, parent_config, required_layout
from mooncake_vllm.v1.refill import cached_block
from mooncake_vllm.v1.scheduler import SchedulerLogic
from mooncake_vllm.v1.telemetry import Telemetry
from mooncake_vllm.v1.worker import WorkerLogic

if TYPE_CHECKING:
    import torch

__all__ = ["INSTANCES", "MooncakeStoreConnector"]

log = logging.getLogger(__name__)

#: Live connectors of this process (tests and the demo read their counters).
INSTANCES: weakref.WeakSet[MooncakeStoreConnector] = weakref.WeakSet()

_BASE_TAKES_KV_CACHE_CONFIG = "kv_cache_config" in inspect.signature(
    KVConnectorBase_V1.__init__).parameters


def _require_supported_vllm() -> None:
    """Refuse a vLLM whose V1 connector API cannot keep saves safe (0.8.5)."""
    facts = installed_facts()
    if facts is None:
        return
    if not facts.our_v1_connector:
        raise UnsupportedVersionError(
            f"mooncake-vllm's V1 MooncakeStoreConnector needs vLLM >= 0.9.0 (found vLLM "
            f"{facts.version}): this release's V1 connector API gives no allocated blocks to "
            f"update_state_after_alloc and cannot delay freeing blocks until they are saved. "
            f"Fix: start vLLM with VLLM_USE_V1=0 (the V0 connector, same pool and keys) or "
            f"upgrade vLLM; `mooncake-vllm check --target-vllm X.Y.Z` shows what changes")


def _installed_fact(name: str) -> bool:
    """A boolean fact of the installed vLLM (``load_error_reporting``: it can recompute
    blocks a background load failed to deliver; ``deferred_lookup``: a lookup may
    answer "ask again later")."""
    facts = installed_facts()
    return facts is not None and bool(getattr(facts, name))


_UNSAFE_LOADS_LOGGED: list[bool] = []


def _loads_are_safe_here() -> bool:
    """Whether this vLLM can recompute a block whose load fails (``load_error_reporting``).

    Before 0.11.1 nothing tells vLLM that a promised block did not arrive (evicted after
    the lookup, corrupt, the pool gone mid-transfer): it would attend to whatever the block
    held. There this connector saves but never loads; said once per process."""
    if _installed_fact("load_error_reporting"):
        return True
    if not _UNSAFE_LOADS_LOGGED:
        _UNSAFE_LOADS_LOGGED.append(True)
        log.warning("mooncake-vllm: this vLLM cannot recompute a block whose load fails "
                    "(get_block_ids_with_load_errors came in vLLM 0.11.1), so a failed or "
                    "raced load would serve wrong KV: this instance saves to the pool but loads "
                    "nothing from it. Fix: vLLM >= 0.11.1 loads (the same pool and keys)")
    return False


def _worker_ranks() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - no distributed groups (single process)
        return 0, 0


class MooncakeStoreConnector(KVConnectorBase_V1):
    """Share vLLM's KV cache through a Mooncake pool, keyed by stable chunk keys."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        follow_vllm_logging()
        _require_supported_vllm()
        #: the enclosing MultiConnector's config (None: we are the engine's connector)
        parent = parent_config(vllm_config)
        if parent is not None:
            check_stats_name(MooncakeStoreConnector, type(self).__name__)
        thread_affinity()  # a bad $MOONCAKE_VLLM_THREAD_AFFINITY or _NICE is refused at start,
        thread_nice()  # not in a thread
        if _BASE_TAKES_KV_CACHE_CONFIG:
            super().__init__(vllm_config, role, kv_cache_config)
        else:  # pragma: no cover - vLLM < 0.11.1
            super().__init__(vllm_config, role)
        ktc = vllm_config.kv_transfer_config
        self.settings = settings = ConnectorSettings.from_vllm_config(vllm_config)
        # hybrid models: refuse at start unless the KV is one full-attention group
        self._groups_checked = kv_cache_config is not None
        if self._groups_checked:
            check_kv_cache_config(kv_cache_config, model=settings.model_id)
        self.kv_role = settings.kv_role
        self.can_save = settings.can_save
        self.can_load = settings.can_load and _loads_are_safe_here()
        self.store_config = load_store_config(settings.mooncake_config_path)
        self.shared: SharedClient = shared_client(self.store_config,
                                                  timeout=settings.connect_timeout)
        tenant = self.store_config.tenant_id
        block_size = int(vllm_config.cache_config.block_size)
        # the layout vLLM gives the KV follows the PARENT's wish (P2P MooncakeConnector: HND)
        wanted = required_layout(parent) if parent is not None else None
        self.scheduler: SchedulerLogic | None = None
        self.worker: WorkerLogic | None = None
        if role == KVConnectorRole.SCHEDULER:
            if settings.load_failure_policy == "recompute" and hasattr(
                    ktc, "kv_load_failure_policy"):
                # The scheduler reads this right after building us: a pool miss is never fatal.
                ktc.kv_load_failure_policy = "recompute"
                adopt_failure_policy(parent, "recompute")  # nested: the scheduler reads the parent's
            waits = self.can_load and _installed_fact("deferred_lookup")
            load_async = settings.load_async and _installed_fact("load_error_reporting")
            self.telemetry = Telemetry(self.shared, vllm_config)
            self.scheduler = SchedulerLogic(rank_namespaces(vllm_config, settings, tenant=tenant,
                                                            required=wanted),
                                            block_size,
                                            self.telemetry.timed_lookup(self._lookup),
                                            can_load=self.can_load,
                                            can_save=self.can_save,
                                            load_async=load_async,
                                            waiter=MarkerWaiter(store_probe(self.shared))
                                            if waits else None,
                                            handoff_timeout=settings.handoff_timeout,
                                            pool_ready=pool_ready(self.shared),
                                            claims=ClaimAdvisor(ClaimRules(settings.load_policy),
                                                                background=load_async),
                                            can_defer=_installed_fact("deferred_lookup"),
                                            audit_lane=AuditLane(
                                                self.telemetry.timed_lookup(self._audit_lookup)),
                                            save_admission=settings.save_admission,
                                            admission_lane=AuditLane(
                                                self.telemetry.timed_lookup(self._audit_lookup),
                                                name="mcv-admission"))
            self.telemetry.attach_scheduler(self.scheduler, kv_cache_config)
            self._announce(self.scheduler.namespaces.namespaces[0])
            namespaces = self.scheduler.namespaces.namespaces
            self.shared.on_connect(lambda client: register_namespaces(client, namespaces,
                                                                      background=True))
        else:
            tp_rank, pp_rank = _worker_ranks()
            (namespace,) = rank_namespaces(vllm_config, settings, tenant=tenant,
                                           only=(tp_rank, pp_rank), required=wanted).namespaces
            layout = expected_layout(vllm_config, pp_rank, variant=settings.layout_variant,
                                     required=wanted)
            self.telemetry = Telemetry(self.shared, vllm_config, worker=namespace)
            assert self.telemetry.source is not None  # a worker's Telemetry meters its clients
            self.worker = WorkerLogic(namespace, layout,
                                      self.telemetry.source, can_load=self.can_load,
                                      can_save=self.can_save,
                                      queue_size=settings.save_queue_size,
                                      gpu_path=settings.gpu_path,
                                      store_clients=settings.clients_for_worker(),
                                      marker_due=settings.marker_due(),
                                      load_probe=settings.load_policy == "auto")
            self.telemetry.attach_worker(self.worker)
        self.shared.start()
        INSTANCES.add(self)

    def _announce(self, ns: Any) -> None:
        try:
            import vllm

            vllm_version = vllm.__version__
        except Exception:  # noqa: BLE001
            vllm_version = "unknown"
        log.info("mooncake-vllm %s: MooncakeStoreConnector on the vLLM V1 engine (vllm %s), "
                 "role %s, pool %s, namespace %s (digest %s)", __version__, vllm_version,
                 self.kv_role, self.store_config.master_server_address, ns.describe(), ns.digest())

    def _lookup(self, keys: Any) -> list[bool]:
        client = self.shared.get()
        if client is None:
            return [False] * len(keys)
        return client.exists(keys)

    def _audit_lookup(self, keys: Any) -> list[bool] | None:
        client = self.shared.get()
        return None if client is None else client.audit_exists(keys)

    # ------------------------------------------------------------------ properties
    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a future miss, not a lost hand-off."""
        return False

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        # on vLLM's thread, after its CPU backend pinned its compute cores: where the pool's
        # threads go (placement.py; the first of our threads to start would decide the same)
        note_compute_cores()
        if not self._groups_checked:  # releases that give connectors no KVCacheConfig
            check_kv_caches(kv_caches, self._vllm_config, model=self.settings.model_id)
        self.worker.register_kv_caches(kv_caches)

    def _meta(self) -> MooncakeConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, MooncakeConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:  # the step timer starts here: the forward pass follows
            self.worker.step_bound(self._meta())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.wait_for_save(self._meta())

    def handle_preemptions(self, kv_connector_metadata: Any = None) -> None:
        if self.worker is None:
            return
        meta = kv_connector_metadata if isinstance(
            kv_connector_metadata, MooncakeConnectorMetadata) else self._meta()
        if meta is not None:
            self.worker.handle_preemptions(meta.preempted_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        meta = self._meta()
        done, received = self.worker.get_finished(
            finished_req_ids, meta.delayed_loads if meta is not None else ())
        return (done or None), (received or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.close()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int = 0) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> MooncakeConnectorMetadata:
        assert self.scheduler is not None
        meta = self.scheduler.build_connector_meta(scheduler_output)
        self.telemetry.planned(meta)
        return meta

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's prefix cache (vLLM >= 0.32): once the pool is back after an outage, what it
        still holds is re-saved without waiting for requests (:class:`~.refill.HbmRefill`).
        Only where vLLM hashes blocks of our chunk size: its i-th block hash is our i-th chunk."""
        sched = self.scheduler
        if sched is not None and self.can_save and \
                getattr(gpu_block_pool, "hash_block_size", sched.block_size) == sched.block_size:
            sched.refill.resolve = cached_block(gpu_block_pool)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def reset_cache(self) -> bool | None:
        """vLLM's connector reset (``POST /reset_prefix_cache?reset_external=true``, a pause
        with ``clear_cache``; fact ``connector_reset_hook``): remove THIS engine's namespaces
        from the pool, every rank's, and nothing else."""
        if self.scheduler is None:
            return None
        return clear_namespaces(self.shared.get(), self.scheduler.namespaces.namespaces) is not None

    # ------------------------------------------------------------------ stats and KV events
    def get_kv_connector_stats(self) -> PoolStats | None:
        """This side's pool counters since the last step (vLLM >= 0.11.0)."""
        return self.telemetry.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PoolStats:
        return PoolStats(data=data) if data is not None else PoolStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        """``vllm:mooncake_vllm_*`` series in the server's /metrics (vLLM >= 0.11.1)."""
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def update_connector_output(self, connector_output: Any) -> None:
        self.telemetry.received(connector_output)

    def take_events(self) -> Any:
        """Scheduler side: BlockStored/BlockRemoved with medium MOONCAKE for vLLM's publisher."""
        return self.telemetry.take_events()

    # ------------------------------------------------------------------ introspection
    def counters(self) -> dict[str, int]:
        """This side's counters plus the shared store client's."""
        out: dict[str, int] = {}
        if self.scheduler is not None:
            out.update({f"scheduler_{k}": v for k, v in self.scheduler.counters.items()})
            out["scheduler_loading_tokens"] = self.scheduler.loading_tokens()
            events = self.telemetry.scheduler_events
            if events is not None:
                out.update({f"scheduler_{k}": v for k, v in events.counters.items()})
        if self.worker is not None:
            out.update({f"worker_{k}": v for k, v in self.worker.counters.items()})
        client = self.shared.get()
        if client is not None:
            out.update({f"store_{k}": v for k, v in client.stats.snapshot().items()})
            out.update({f"store_{op}_us": int(sec * 1e6)
                        for op, sec in dict(client.stats.latency_sum).items()})
        return out
