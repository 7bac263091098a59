"""Hand-off markers a prefill worker declared and has not published yet (issue 27).

The save thread publishes a request's marker right after that request's saves (one
FIFO); if they are not done by the marker's due time (half of ``handoff_timeout``),
:class:`DueMarkers`' own thread publishes it first, with the chunks present by then.
:meth:`DueMarkers.take` lets exactly one of them publish each marker.

The due thread is neither moved off vLLM's cores nor reniced: it must run when the save
thread, starved or stuck in a put, cannot. A marker it finds
:data:`~mooncake_vllm.store.timebox.STALL_GRACE` past due woke late — this process or
the machine stood still, and the save that marker waits for may need only a moment
more — so it is due once more, ``STALL_GRACE`` later.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.store.timebox import STALL_GRACE

__all__ = ["DueMarkers", "Marker", "due_now"]


@dataclass(eq=False)
class Marker:
    """Hand-off ``handoff_id``'s marker, declared at ``declared`` and due at ``due``
    (monotonic seconds); ``taken``: someone publishes it (once)."""

    req_id: str
    handoff_id: str
    digests: list[str]
    due: float
    declared: float
    taken: bool = False
    stalled: bool = False  #: its due time was pushed back once after a stall


def due_now(markers: Sequence[Marker], now: float) -> list[Marker]:
    """The markers due at ``now``; one found :data:`STALL_GRACE` past due (its watcher woke
    late) is not, once: it is due again ``STALL_GRACE`` from now."""
    for m in markers:
        if m.due <= now - STALL_GRACE and not m.stalled:
            m.due, m.stalled = now + STALL_GRACE, True
    return [m for m in markers if m.due <= now]


class DueMarkers:
    """The declared markers, and the thread that publishes those that come due."""

    def __init__(self, publish_due: Callable[[Marker], None], *, due_after: float,
                 clock: Callable[[], float]) -> None:
        self._publish_due = publish_due
        self._due_after = due_after
        self._clock = clock
        self._cond = threading.Condition()
        self._markers: list[Marker] = []  # declared, not yet taken, in due order
        self._thread: threading.Thread | None = None
        self._stopping = False

    def declare(self, req_id: str, handoff_id: str, digests: Sequence[str]) -> Marker:
        now = self._clock()
        marker = Marker(req_id, handoff_id, list(digests), now + self._due_after, now)
        with self._cond:
            self._markers.append(marker)
            self._cond.notify_all()
        return marker

    def take(self, marker: Marker) -> bool:
        """Claim ``marker`` for publishing: ``False`` when it was taken already."""
        with self._cond:
            if marker.taken:
                return False
            marker.taken = True
            if marker in self._markers:
                self._markers.remove(marker)
            return True

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mcv-handoff-due", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _loop(self) -> None:
        off_compute_cores()
        while True:
            with self._cond:
                while not self._stopping:
                    now = self._clock()
                    due = due_now(self._markers, now)
                    if due:
                        break
                    wait = min((m.due for m in self._markers), default=now + 1.0) - now
                    self._cond.wait(max(0.001, min(wait, 1.0)))
                if self._stopping:
                    return
            for marker in due:
                if self.take(marker):
                    self._publish_due(marker)
