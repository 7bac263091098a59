"""DueMarkers (v1/markers.py): which declared hand-off markers are due, with a fake clock;
one taken once; the due thread publishes what the save thread did not reach."""

from __future__ import annotations

import time

from mooncake_vllm.store.timebox import STALL_GRACE
from mooncake_vllm.v1.markers import DueMarkers, Marker, due_now


def _marker(due: float) -> Marker:
    return Marker("r", "h", ["d"], due=due, declared=due - 2.5)


def test_a_marker_is_due_at_its_due_time() -> None:
    m = _marker(10.0)
    assert due_now([m], 9.99) == []
    assert due_now([m], 10.0 + STALL_GRACE / 2) == [m]


def test_a_marker_found_long_past_due_waits_once_more_for_its_save() -> None:
    """Its watcher woke STALL_GRACE or more late (the process or the machine stood still,
    soak and CI: a 1P1D marker published 2.5 s late with none of its blocks, the put they
    waited for answering a moment later): due again STALL_GRACE later, then published."""
    m = _marker(10.0)
    assert due_now([m], 13.0) == [] and m.stalled and m.due == 13.0 + STALL_GRACE
    assert due_now([m], 13.0 + STALL_GRACE) == [m]
    assert due_now([m], 20.0) == [m]  # only once


def test_the_save_thread_or_the_due_thread_publishes_each_marker_once() -> None:
    published: list[Marker] = []
    markers = DueMarkers(published.append, due_after=0.05, clock=time.monotonic)
    markers.start()
    try:
        first = markers.declare("a", "h1", ["d"])
        assert markers.take(first)  # the save thread got there first
        late = markers.declare("b", "h2", ["d"])
        deadline = time.monotonic() + 5
        while not published and time.monotonic() < deadline:
            time.sleep(0.01)
        assert published == [late]
        assert not markers.take(first) and not markers.take(late)
    finally:
        markers.stop()
