"""Background loads for the V1 worker: one thread, one request's blocks at a time.

A request whose load runs here is parked by vLLM (WAITING_FOR_REMOTE_KVS) while
the engine keeps stepping every other request; the worker reports it once its
blocks are in place (or known bad). On CUDA the copies run on the store's load
stream after an event taken on vLLM's stream when the load was issued, and are
complete before the request is reported.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.v1.metadata import BlockJob

__all__ = ["BackgroundLoads", "LoadOrder"]

log = logging.getLogger(__name__)

_STOP = object()


@dataclass
class LoadOrder:
    """One request's background load."""

    job: BlockJob
    keys: list[str]
    client: Any
    layout: Any
    after: Any  #: event on vLLM's stream taken when the load was issued (CUDA), or None
    seconds: float = 0.0  #: the transfer's duration (not its wait in the queue), once done


class BackgroundLoads:
    """Runs :class:`LoadOrder` s on one thread; ``done(order, ok)`` reports each."""

    def __init__(self, done: Callable[[LoadOrder, list[bool]], None]) -> None:
        self._done = done
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="mcv-load", daemon=True)
        self._thread.start()

    def submit(self, order: LoadOrder) -> None:
        self._queue.put(order)

    def _loop(self) -> None:
        off_compute_cores()
        while True:
            order = self._queue.get()
            if order is _STOP:
                return
            started = time.perf_counter()
            try:
                ok = order.client.get_blocks(order.keys, order.layout, order.job.block_ids,
                                             after=order.after, background=True)
                order.seconds = time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001 - a failed load is recomputed
                log.warning("mooncake-vllm: loading %d blocks failed (%s); vLLM recomputes "
                            "them", len(order.job.block_ids), exc)
                ok = [False] * len(order.job.block_ids)
            self._done(order, ok)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)
