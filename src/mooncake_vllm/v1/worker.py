"""Worker side of the V1 connector: load before the forward, save after it, off-thread.

* **Loads** are issued in ``start_load_kv``: background jobs go to the loader
  thread (:mod:`~mooncake_vllm.v1.loads`) and are reported through
  ``get_finished``'s finished-receiving set; synchronous ones (releases without
  load-error reporting) run there, before the forward pass: one batched,
  verified ``get_blocks``. A block that is missing, foreign or corrupt is
  reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it.
  On CUDA a synchronous scatter is ordered before the forward on vLLM's own
  stream (no device sync).
* **Saves** are captured in ``wait_for_save`` (after the forward pass wrote the
  KV), on the engine's thread, and put by one background thread through a
  bounded queue; a full queue drops the save (a future miss), never stalls the
  engine. A capture is either a snapshot (CUDA KV, staged: the blocks are copied
  to staging and free again at once; one per step) or, for host KV and GPU zero-copy, checksums
  of the blocks taken while their bytes are known good; such a request's blocks are held
  until its puts finish, for at most ``save_deadline`` seconds. Whatever the
  timing, a block that vLLM reused before its put read it no longer matches its
  checksum: the reader refuses it and the writer removes it.
* **Hand-off markers** (:mod:`~mooncake_vllm.v1.handoff`): a hand-off declared
  in a step's metadata is queued behind that request's saves on the same save
  thread (:mod:`~mooncake_vllm.v1.save_thread`), published once they are committed
  or when due (``marker_due``, half of ``handoff_timeout``), whichever comes first.
* **Preemption** never waits for the pool: queued zero-copy saves of a
  preempted request are cancelled, one in flight gets ``preempt_wait`` seconds.
* **CUDA snapshots never stall the forward pass**: where the release reports
  preemptions, the copy out of vLLM's blocks runs beside the next steps; its
  :class:`~mooncake_vllm.store.mover.CopyFence` is ordered (vLLM's stream waits
  for the copy, the host never does) when vLLM may reuse the blocks: when the
  request's blocks are freed (``get_finished``) or it is preempted. Elsewhere
  the fence is ordered at capture, as V0 does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.stats import CounterNames, Counters
from mooncake_vllm.v1.loads import BackgroundLoads, LoadOrder
from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata
from mooncake_vllm.v1.namespace import ExpectedLayout, check_layout
from mooncake_vllm.v1.perf import StepTimer
from mooncake_vllm.v1.save_thread import SaveThread

if TYPE_CHECKING:
    from mooncake_vllm.v1.client import ClientSource

__all__ = ["COUNTERS", "WorkerLogic"]

log = logging.getLogger(__name__)

#: longest wait in ``get_finished`` of a step that scheduled nothing while a background
#: load runs: the engine thread would otherwise spin through empty steps holding the
#: GIL and starve the loader thread (a 1k-token CPU hit took ~0.9 s instead of ~0.2 s)
IDLE_STEP_WAIT = 0.005
#: :attr:`WorkerLogic.counters`
COUNTERS = CounterNames(initial=(
    "loaded_blocks", "failed_blocks", "saved_blocks",
    "copy_fences",  # snapshot copies vLLM's stream did not wait for
    "copy_fences_waited",  # ... still running when the blocks were freed
    "save_jobs", "dropped_jobs", "cancelled_jobs",
    "dropped_blocks",  # planned saves that never reached the pool
    "holds_expired", "handoff_markers", "handoff_markers_failed",
    "handoff_markers_due"))  # published at their due time, before the saves ahead finished


class WorkerLogic:
    """Per-worker loads, saves and save-completion tracking."""

    def __init__(self, namespace: KeyNamespace, expected: ExpectedLayout,
                 client_source: ClientSource, *,
                 can_load: bool, can_save: bool, queue_size: int = 64,
                 save_deadline: float = 30.0, preempt_wait: float = 1.0,
                 clock: Any = time.monotonic, gpu_path: str = "auto",
                 store_clients: int = 1, marker_due: float = 2.5,
                 load_probe: bool = False) -> None:
        self.namespace = namespace
        self.prefix = namespace.prefix()
        self.expected = expected
        self.source = client_source
        self.can_load = can_load
        self.can_save = can_save and namespace.stores  # MLA: only TP rank 0 puts
        self.gpu_path = gpu_path
        self.store_clients = store_clients
        #: time a few throw-away loads once connected (CUDA KV: :meth:`_probe_loads`)
        self.load_probe = load_probe and can_load
        self.layout: BlockLayout | None = None
        #: times steps and loads for the scheduler's claim policy (set at registration)
        self.timer = StepTimer()
        self._save_deadline = save_deadline
        self._preempt_wait = preempt_wait
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: dict[str, int] = {}  # req_id -> zero-copy saves not yet finished
        self._held_since: dict[str, float] = {}  # req_id -> first hold still pending
        self._cancelled: set[str] = set()  # preempted: skip their queued zero-copy saves
        self._tracked: set[str] = set()  # requests whose blocks the scheduler keeps for us
        self._finished: set[str] = set()  # tracked requests vLLM has finished
        self._load_errors: set[int] = set()
        self._idle_step = False  # this step schedules no token (metadata.idle_step)
        self._loading: dict[str, int] = {}  # req_id -> background loads not yet over
        self._received: set[str] = set()  # background loads over, not yet reported
        self._loads: BackgroundLoads | None = None
        self._probing = False  # a load probe runs (:meth:`_probe_loads`)
        self._fences: dict[str, list[Any]] = {}  # req_id -> CopyFences not yet ordered
        #: read freely; counted only through :meth:`_count` (engine and save threads)
        self.counters = Counters(COUNTERS)
        self._saves = SaveThread(client_source, self.prefix, self.keys, self._count,
                                 cancelled=self._any_cancelled, job_done=self._job_done,
                                 queue_size=queue_size, marker_due=marker_due, clock=clock)

    def _count(self, name: str, amount: int = 1) -> None:
        """Add to a counter (under the lock: the engine and save threads both count)."""
        with self._cond:  # reentrant: callers may hold it
            self.counters[name] += amount

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: Any) -> None:
        """Build the block layout, check it matches the keys' namespace, register memory."""
        layout = BlockLayout.from_kv_caches(kv_caches, kind=self.expected.kind,
                                            variant=self.expected.variant)
        check_layout(self.expected, layout)
        self.layout = layout
        if layout.on_cuda:
            self.timer = StepTimer(cuda_device=layout.device)
            self.timer.probes = self.load_probe
        self.source.on_connect(lambda client: client.register_layout(
            layout, self.gpu_path, clients=self.store_clients))
        if self.timer.probes:  # CUDA KV with the probe on
            self.source.on_connect(self._probe_loads)
        if self.can_save:
            self._saves.start()

    def _probe_loads(self, client: Any, *, again: bool = False) -> None:
        """Seed the claim policy's load model before the first hit, or measure the pool again
        while claims are declined (``metadata.probe_loads``), off vLLM's thread: throw-away
        loads, never a request's blocks. Only for CUDA KV: on the host a load is a memory
        copy, measured by the real ones. One probe at a time; only the first is logged at
        INFO (``again``: asked while declining, every ``explore_every`` s at most)."""
        with self._cond:
            if self._probing:
                return
            self._probing = True

        def run() -> None:
            off_compute_cores()
            try:
                assert self.layout is not None
                bs = self.namespace.block_size
                samples = client.probe_loads(self.layout)
                for blocks, seconds in samples:
                    self.timer.load_done(blocks * bs, seconds)
                log.log(logging.DEBUG if again else logging.INFO, "mooncake-vllm: load probe: %s", ", ".join(
                    f"{b * bs} tokens in {s * 1e3:.1f} ms" for b, s in samples) or "no answer")
            finally:
                with self._cond:
                    self._probing = False

        threading.Thread(target=run, name="mcv-load-probe", daemon=True).start()

    def keys(self, digests: Iterable[str]) -> list[str]:
        return [f"{self.prefix}/{d}" for d in digests]

    # ------------------------------------------------------------------ loads
    def step_bound(self, meta: MooncakeConnectorMetadata | None) -> None:
        """vLLM bound this step's metadata: its forward pass follows (every release binds
        before the forward; vLLM >= 0.32 starts async loads only after launching it)."""
        self.timer.step_began(meta.step_work if meta is not None else None)

    def start_load_kv(self, meta: MooncakeConnectorMetadata | None) -> None:
        """Issue this step's loads; failures go to :meth:`take_load_errors`."""
        self._idle_step = meta is not None and meta.idle_step
        if meta is None:
            return
        if meta.probe_loads and self.timer.probes and not meta.loads and not self._loading:
            # CUDA KV with the probe on, and no load of ours for its slots to compete with
            client = self.source.get()
            if client is not None:
                self._probe_loads(client, again=True)
        self._order_fences(meta.preempted_req_ids)  # before this forward may write them
        if meta.delayed_loads:
            with self._cond:
                self._tracked |= meta.delayed_loads
        if not meta.loads:
            return
        client = self.source.get() if self.layout is not None and self.can_load else None
        background = [job for job in meta.loads if job.background]
        for job in background:
            self._load_in_background(job, client)
        jobs = [job for job in meta.loads if not job.background]
        if not jobs:
            return
        block_ids = [b for job in jobs for b in job.block_ids]
        if client is None:
            self._fail(block_ids)
            return
        assert self.layout is not None  # no client without a layout (above)
        keys = [k for job in jobs for k in self.keys(job.digests)]
        started = time.perf_counter()
        try:
            ok = client.get_blocks(keys, self.layout, block_ids)
            bs = self.namespace.block_size
            self.timer.load_done(len(block_ids) * bs, time.perf_counter() - started, sum(ok) * bs)
        except Exception as exc:  # noqa: BLE001 - never let a load kill the engine
            log.warning("mooncake-vllm: loading %d blocks failed (%s); vLLM recomputes them",
                        len(block_ids), exc)
            ok = [False] * len(block_ids)
        failed = [b for b, good in zip(block_ids, ok) if not good]
        self._count("loaded_blocks", len(block_ids) - len(failed))
        if failed:
            self._fail(failed)

    def _load_in_background(self, job: BlockJob, client: Any) -> None:
        with self._cond:
            self._loading[job.req_id] = self._loading.get(job.req_id, 0) + 1
        order = LoadOrder(job, self.keys(job.digests), client, self.layout, None)
        if client is None:
            self._loaded(order, [False] * len(job.block_ids))
            return
        if self._loads is None:
            self._loads = BackgroundLoads(self._loaded)
        order.after = client.stream_position(self.layout)  # on vLLM's thread and stream
        self._loads.submit(order)

    def _loaded(self, order: LoadOrder, ok: list[bool]) -> None:
        if order.seconds > 0:
            bs = self.namespace.block_size
            self.timer.load_done(len(order.job.block_ids) * bs, order.seconds, sum(ok) * bs)
        failed = [b for b, good in zip(order.job.block_ids, ok) if not good]
        req = order.job.req_id
        with self._cond:
            self._count("loaded_blocks", len(ok) - len(failed))
            self._count("failed_blocks", len(failed))
            self._load_errors.update(failed)
            left = self._loading.get(req, 1) - 1
            if left > 0:
                self._loading[req] = left
            else:
                self._loading.pop(req, None)
                self._received.add(req)
            self._cond.notify_all()

    def _fail(self, block_ids: list[int]) -> None:
        with self._cond:
            self._count("failed_blocks", len(block_ids))
            self._load_errors.update(block_ids)

    def take_load_errors(self) -> set[int]:
        with self._cond:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ saves
    def wait_for_save(self, meta: MooncakeConnectorMetadata | None) -> None:
        """Capture this step's saves (the forward pass has written their KV) and queue them,
        then the marks of chunks first seen (``save_admission: "repeat"``) and the hand-off
        markers declared this step (after their requests' saves)."""
        self.timer.step_ended()
        if meta is None or not (meta.saves or meta.handoffs or meta.marks):
            return
        client = self.source.get() if self.can_save and self.layout is not None else None
        # vLLM tells the workers of preemptions: a CUDA copy's fence may wait until the free
        self._queue_saves(meta.saves, client, defer_fences=meta.preemptions_reported)
        if self.can_save and self._saves.running:
            if meta.marks and client is not None:
                self._saves.mark(meta.marks, client)
            for req_id, (handoff_id, digests) in meta.handoffs.items():
                self._saves.declare(req_id, handoff_id, digests)

    def _queue_saves(self, saves: list[BlockJob], client: Any, *, defer_fences: bool) -> None:
        for job in saves:
            with self._cond:
                if not job.unheld:  # a refill from vLLM's prefix cache: no request to free
                    self._tracked.add(job.req_id)
                self._cancelled.discard(job.req_id)
        if client is None:
            self._count("dropped_blocks", sum(len(job.block_ids) for job in saves))
            return
        for group in self._capture_groups(saves, client):
            self._capture(group, client, defer_fences=defer_fences)

    def _capture_groups(self, saves: list[BlockJob], client: Any) -> list[list[BlockJob]]:
        """Snapshots: the step's saves in one capture (a CUDA capture costs vLLM's thread
        ~0.6 ms of launches and events, one block or a hundred), refills of vLLM's prefix
        cache (fenced at capture) apart; held saves: one per request (its own put frees it)."""
        if len(saves) > 1 and client.saves_snapshot(self.layout):
            held = [job for job in saves if not job.unheld]
            unheld = [job for job in saves if job.unheld]
            return [group for group in (held, unheld) if group]
        return [[job] for job in saves]

    def _capture(self, jobs: list[BlockJob], client: Any, *, defer_fences: bool) -> None:
        """Capture ``jobs``' blocks as one save and queue it (or drop it: the queue is full).
        A key two requests of the step computed (one prompt twice in a burst) is taken once;
        a job that asks (``ask_admission``) has its new blocks stored only if seen before."""
        first: dict[str, int] = {}  # key -> its first block (dicts keep insertion order)
        asking = any(job.ask_admission for job in jobs)
        always: set[str] = set()  # (only where a job asks) the keys of those that do not
        for job in jobs:
            keys = self.keys(job.digests)
            for key, block in zip(keys, job.block_ids):
                first.setdefault(key, block)
            if asking and not job.ask_admission:
                always.update(keys)
        keys, block_ids = list(first), list(first.values())
        try:
            # a refill of vLLM's prefix cache has no free to wait for: its fence is ordered now
            ticket = client.prepare_save(
                keys, self.layout, block_ids,
                defer_fence=defer_fences and not any(job.unheld for job in jobs),
                admission="repeat" if asking else "all", always=always)
        except Exception as exc:  # noqa: BLE001 - a failed capture is a future miss
            log.warning("mooncake-vllm: capturing %d blocks for saving failed: %s",
                        len(block_ids), exc)
            return
        if ticket.fence is not None:
            with self._cond:
                for req_id in {job.req_id for job in jobs}:
                    self._fences.setdefault(req_id, []).append(ticket.fence)
                self._count("copy_fences")
        if not ticket.keys:
            return
        if not ticket.snapshot:
            for job in jobs:
                self._hold(job.req_id)
        if self._saves.offer(jobs, ticket, client):
            self._count("save_jobs", len(jobs))
            return
        self._count("dropped_jobs", len(jobs))
        self._count("dropped_blocks", len(ticket.keys))
        client.discard(ticket)
        if not ticket.snapshot:
            for job in jobs:
                self._job_done(job.req_id)

    def _hold(self, req_id: str) -> None:
        with self._cond:
            self._pending[req_id] = self._pending.get(req_id, 0) + 1
            self._held_since.setdefault(req_id, self._clock())

    def _any_cancelled(self, jobs: list[BlockJob]) -> bool:
        """A request of ``jobs`` was preempted since its capture (the save thread asks)."""
        with self._cond:
            return any(job.req_id in self._cancelled for job in jobs)

    def _order_fences(self, req_ids: Iterable[str]) -> None:
        """vLLM may reuse these requests' blocks: its stream waits for our copies of them."""
        with self._cond:
            fences = [f for r in req_ids for f in self._fences.pop(r, ())]
        waited = sum(fence.order() for fence in fences)
        if waited:
            self._count("copy_fences_waited", waited)

    def _job_done(self, req_id: str) -> None:
        with self._cond:
            left = self._pending.get(req_id, 1) - 1
            if left > 0:
                self._pending[req_id] = left
            else:
                self._pending.pop(req_id, None)
                self._held_since.pop(req_id, None)
            self._cond.notify_all()

    def handle_preemptions(self, preempted: Iterable[str]) -> None:
        """Before vLLM reuses preempted requests' blocks: cancel their queued saves.

        A put already reading them gets ``preempt_wait`` seconds; if it is still
        running then, its checksum (taken at capture) keeps the result honest.
        """
        wanted = set(preempted)
        if not wanted:
            return
        self._order_fences(wanted)
        deadline = self._clock() + self._preempt_wait
        with self._cond:
            self._cancelled |= wanted
            while any(r in self._pending for r in wanted):
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(left)

    def get_finished(self, finished_req_ids: Iterable[str],
                     delayed_loads: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        """``(blocks that may be freed now, background loads that are over)``.

        Freed: finished requests whose blocks vLLM kept for us — no zero-copy save
        still reading them (or held longer than ``save_deadline``: a hung pool
        never keeps vLLM's blocks) and no background load still writing them
        (loads are time-boxed). Loads over: their requests may be scheduled.
        """
        now = self._clock()
        finished = set(finished_req_ids)
        with self._cond:
            if self._idle_step and self._loading and not self._received:
                # nothing to compute this step: hand the GIL to the loader thread
                self._cond.wait_for(lambda: bool(self._received) or not self._loading,
                                    timeout=IDLE_STEP_WAIT)
            self._tracked |= set(delayed_loads)
            self._finished.update(r for r in finished if r in self._tracked)
            expired = {r for r in self._finished if r in self._pending
                       and now - self._held_since.get(r, now) >= self._save_deadline}
            done = {r for r in self._finished
                    if r not in self._pending and r not in self._loading} | (
                        expired - set(self._loading))
            self._finished -= done
            self._tracked -= done
            self._cancelled |= expired
            received = self._received - finished - self._finished - done
            self._received -= received | done | finished
        self._order_fences(done)
        if expired:
            self._count("holds_expired", len(expired))
            log.warning("mooncake-vllm: released the blocks of %d finished request(s) whose "
                        "saves did not finish within %.0f s", len(expired), self._save_deadline)
        return done, received

    def idle(self) -> bool:
        """No save queued or running (tests and shutdown)."""
        with self._cond:
            return not self._pending and not self._loading and not self._saves.busy()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Let queued saves finish (bounded), then stop the save and load threads."""
        loads, self._loads = self._loads, None
        if loads is not None:
            loads.shutdown(timeout)
        self._saves.stop(timeout)
