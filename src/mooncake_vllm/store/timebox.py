"""Every call into Mooncake runs on a bounded worker pool with a deadline.

A call that outlives its deadline is abandoned, not cancelled (a pybind call
cannot be interrupted): the caller gets :class:`CallTimedOut` at once, the call
keeps its worker until Mooncake returns, and whatever memory it reads or writes
stays reserved until then (``on_done``). A call that finds every worker busy
waits for one within its own deadline (calls of other threads that are merely
in flight are no sign of trouble); when none frees up in that time — every
worker held by a call at least that long — it is refused (:class:`CallRejected`)
instead of queueing without bound.

A deadline is judged by a waiter that ran: a box with a ``grace`` looks once more, that
long, before abandoning a call, because the waiter may wake past the deadline after the
whole process or machine stood still (a paused VM, an overloaded box) while the call
itself needed only a moment more. The saves, save lookups, published markers and block
transfers have one (a synchronous load — ``load_async`` off, or V0 — thus waits at most
the grace longer on vLLM's thread); the scheduler's lookups do not.

Workers start off vLLM's compute cores (:func:`~mooncake_vllm.placement.off_compute_cores`,
unless the box names its own ``initializer``): a worker is started by whichever thread
submits first, often vLLM's own (a lookup, a probe), and would otherwise share its cores.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from mooncake_vllm.errors import CallRejected, CallTimedOut
from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.store.codes import call

__all__ = ["STALL_GRACE", "LateRelease", "TimeBox"]

#: how long a waiter that found its deadline passed looks once more (seconds): a call that
#: answers within it was held up by a stall of its waiter's process or machine, not hung
STALL_GRACE = 0.25


class TimeBox:
    """``workers`` threads; at most ``workers`` calls in flight, hung ones included — plus up
    to ``spare`` calls abandoned at their deadline, whose workers are replaced at once
    (they hold a spare thread until they return): a box whose calls hang on one peer
    still serves calls to the others."""

    def __init__(self, name: str, workers: int = 1,
                 initializer: Callable[[], None] | None = None, spare: int = 0,
                 grace: float = 0.0) -> None:
        self.name = name
        self.grace = grace
        #: calls that answered within the grace after their deadline
        self.answered_in_grace = 0
        self._slots = threading.Semaphore(workers)
        self._pool = ThreadPoolExecutor(max_workers=workers + spare, thread_name_prefix=f"mcv-{name}",
                                        initializer=initializer or off_compute_cores)
        self._spare = spare
        self._abandoned: set[int] = set()  # ids of futures whose slot was handed on
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = 0  #: calls started and not yet returned (abandoned ones included)
        self._closed = False

    def run(self, timeout: float, fn: Callable[..., Any], *args: Any,
            on_done: Callable[[Any], None] | None = None) -> Any:
        """``fn(*args)`` (an exception comes back as the value), or raise.

        ``on_done(result)`` runs once the call has really returned, also after a
        timeout: that is where memory the call used may be handed back.
        """
        deadline = time.monotonic() + timeout
        fut = self.submit(fn, *args, on_done=on_done, wait=timeout)
        return self.result(fut, max(0.0, deadline - time.monotonic()))

    def submit(self, fn: Callable[..., Any], *args: Any,
               on_done: Callable[[Any], None] | None = None, wait: float = 0.0) -> Future[Any]:
        """Start ``fn(*args)`` (waiting up to ``wait`` s for a free worker); collect it
        with :meth:`result` (pipelined calls)."""
        got = not self._closed and (self._slots.acquire(timeout=wait) if wait > 0
                                    else self._slots.acquire(blocking=False))
        if not got:
            raise CallRejected(f"{self.name}: all workers busy with unanswered calls"
                               + (f" for {wait:.1f} s" if wait > 0 else ""))
        if self._closed:
            self._slots.release()
            raise CallRejected(f"{self.name}: closed")
        with self._lock:
            self._running += 1
        try:
            fut: Future[Any] = self._pool.submit(call, fn, *args)
        except RuntimeError as exc:  # shut down meanwhile
            self._slots.release()
            self._returned()
            raise CallRejected(f"{self.name}: closed") from exc

        def finished(f: Future[Any]) -> None:
            self._returned()
            with self._lock:
                handed_on = id(f) in self._abandoned
                self._abandoned.discard(id(f))
            if not handed_on:
                self._slots.release()
            if on_done is not None:
                on_done(f.result())

        fut.add_done_callback(finished)
        return fut

    def result(self, fut: Future[Any], timeout: float) -> Any:
        """The call's value, or :class:`CallTimedOut` after ``timeout`` seconds."""
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            pass
        if self.grace > 0:
            try:
                value = fut.result(timeout=self.grace)
            except FutureTimeout:
                pass
            else:
                with self._lock:
                    self.answered_in_grace += 1
                return value
        self.abandon(fut)
        raise CallTimedOut(f"{self.name}: no answer within {timeout + self.grace:.1f} s") from None

    def abandon(self, fut: Future[Any]) -> None:
        """The caller gives up on ``fut``: while spares last, its slot is handed on at once
        (its worker stays held until it returns; a spare thread serves the next call)."""
        with self._lock:
            spare = len(self._abandoned) < self._spare and not fut.done()
            if spare:
                self._abandoned.add(id(fut))
        if spare:
            self._slots.release()

    def _returned(self) -> None:
        with self._idle:
            self._running -= 1
            if self._running == 0:
                self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no call this box started is still running (an
        abandoned one included); whether none is."""
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)


class LateRelease:
    """Hands memory back when a call returns, also one abandoned at its deadline.

    ``calls``: how many calls read or write that memory (a striped transfer runs one
    per lane); after the caller gives up, it comes back once every one has returned.
    """

    def __init__(self, release: Callable[[], None], calls: int = 1) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._pending = calls
        self._timed_out = self._released = False

    def returned(self, _result: Any) -> None:
        """``on_done`` of a call: release now if the caller gave up and it was the last."""
        with self._lock:
            self._pending -= 1
        self._maybe_release()

    def timed_out(self) -> None:
        """The caller gives up: release when (or since) every call has returned."""
        with self._lock:
            self._timed_out = True
        self._maybe_release()

    def _maybe_release(self) -> None:
        with self._lock:
            due = self._timed_out and self._pending <= 0 and not self._released
            self._released = self._released or due
        if due:
            self._release()
