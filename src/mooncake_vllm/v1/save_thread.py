"""The worker's save thread: captured saves put in order, hand-off markers behind them.

:class:`~mooncake_vllm.v1.worker.WorkerLogic` captures a step's saves on vLLM's thread and
offers them here; one thread commits them in order through a bounded queue (a full queue
refuses the save: a future miss, never a stalled engine). A hand-off marker declared in a
step goes into the same queue behind that request's saves: once they are committed the
thread publishes it with the chunks present. A marker is due ``marker_due`` seconds after
its declaration (:class:`~mooncake_vllm.v1.markers.DueMarkers`): if the saves ahead of it
are still running then, the due thread publishes it at once with what is present so far,
so the decode instance stops waiting and recomputes the rest (issue 27).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from mooncake_vllm.handoff_protocol import handoff_key, marker_value
from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.store.health import FailureLog
from mooncake_vllm.v1.markers import DueMarkers, Marker
from mooncake_vllm.v1.metadata import BlockJob

if TYPE_CHECKING:
    from mooncake_vllm.v1.client import ClientSource

__all__ = ["SaveThread"]

log = logging.getLogger(__name__)

_STOP = object()


class _Marks:
    __slots__ = ("client", "digests")

    def __init__(self, digests: list[str], client: Any) -> None:
        self.digests, self.client = digests, client


class SaveThread:
    """Commits captured saves in order and publishes hand-off markers behind them.

    The owner tells it which captured jobs were cancelled meanwhile (``cancelled``: their
    blocks may hold another request's KV by now), hears when a held job is over
    (``job_done``) and keeps the counters (``count``)."""

    def __init__(self, source: ClientSource, prefix: str, keys: Callable[[Iterable[str]], list[str]],
                 count: Callable[[str, int], None], *, cancelled: Callable[[list[BlockJob]], bool],
                 job_done: Callable[[str], None], queue_size: int, marker_due: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.prefix = prefix
        self.keys = keys
        self._count = count
        self._cancelled = cancelled
        self._job_done = job_done
        self._clock = clock
        # unbounded so a marker always finds room; save jobs stop at queue_size
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queue_size = queue_size
        self._thread: threading.Thread | None = None
        self._markers = DueMarkers(self._publish_due, due_after=marker_due, clock=clock)
        self._due_log = FailureLog()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mcv-save", daemon=True)
            self._thread.start()
            self._markers.start()

    def offer(self, jobs: list[BlockJob], ticket: Any, client: Any) -> bool:
        """Queue a captured save; ``False``: the queue is full (the caller drops it)."""
        if self._queue.qsize() >= self._queue_size:
            return False
        self._queue.put_nowait((jobs, ticket, client))
        return True

    def mark(self, digests: list[str], client: Any) -> None:
        """Put the marks of chunks first seen under ``save_admission: "repeat"``, in order
        with the saves (never refused: a mark is a few bytes, and the queue of marks is
        bounded by the steps' saves)."""
        self._queue.put_nowait(_Marks(digests, client))

    def declare(self, req_id: str, handoff_id: str, digests: Sequence[str]) -> None:
        """A hand-off marker, published once the saves queued before it are committed (or
        when it is due)."""
        self._queue.put_nowait(self._markers.declare(req_id, handoff_id, digests))

    def busy(self) -> bool:
        """A save or marker is queued or running."""
        return self._queue.unfinished_tasks > 0

    def stop(self, timeout: float) -> None:
        """Let queued saves finish (bounded), then stop."""
        self._markers.stop()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(_STOP)
        thread.join(timeout)

    def _loop(self) -> None:
        off_compute_cores()
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            if isinstance(item, _Marks):
                try:
                    item.client.mark_seen(self.keys(item.digests))
                except Exception as exc:  # noqa: BLE001 - a lost mark: a first sighting again
                    log.warning("mooncake-vllm: putting %d seen marks failed: %s", len(item.digests), exc)
                finally:
                    self._queue.task_done()
                continue
            if isinstance(item, Marker):
                try:
                    if self._markers.take(item):
                        self._publish(item)
                finally:
                    self._queue.task_done()
                continue
            jobs, ticket, client = item
            try:
                if not ticket.snapshot and self._cancelled(jobs):
                    self._count("cancelled_jobs", len(jobs))
                    self._count("dropped_blocks", len(ticket.keys))
                    client.discard(ticket)
                else:
                    self._count("saved_blocks", client.commit_save(ticket))
            except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
                log.warning("mooncake-vllm: saving %d blocks failed: %s", len(ticket.keys), exc)
            finally:
                if not ticket.snapshot:
                    for job in jobs:
                        self._job_done(job.req_id)
                self._queue.task_done()

    def _publish_due(self, marker: Marker) -> None:
        """Its due time passed before the save thread reached it: publish what is present."""
        late = self._clock() - marker.declared
        self._publish(marker)
        self._count("handoff_markers_due", 1)
        self._due_log.warn("due", (
            f"mooncake-vllm: hand-off marker of request {marker.req_id} published "
            f"{late:.1f} s after its declaration, before its saves finished (the pool "
            "puts were slower than half of handoff_timeout): the decode instance "
            "loads what is present and recomputes the rest (counter "
            "worker_handoff_markers_due)"))

    def _publish(self, marker: Marker) -> None:
        """The request's saves are committed (or its marker is due): say how many leading
        chunks are present."""
        client = self.source.get()
        ok = False
        if client is not None:
            try:
                ok = client.publish_marker(
                    handoff_key(self.prefix, marker.handoff_id), self.keys(marker.digests),
                    lambda present: marker_value(len(marker.digests), present))
            except Exception as exc:  # noqa: BLE001 - the decode waits its bound, then recomputes
                log.warning("mooncake-vllm: publishing hand-off marker failed: %s", exc)
        self._count("handoff_markers" if ok else "handoff_markers_failed", 1)
