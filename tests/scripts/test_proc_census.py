"""bench/proc_census.py: threads, CPU seconds, affinities and the collector, read from /proc."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.scripts._load import load_script

census = load_script("bench/proc_census.py")

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc only")


def test_a_pinned_named_thread_shows_its_cpus() -> None:
    before = census.thread_cpu()
    seen: dict[str, object] = {}
    cpu = min(os.sched_getaffinity(0))

    def burn() -> None:
        os.sched_setaffinity(0, {cpu})
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        seen["affinity"] = census.thread_affinity()

    thread = threading.Thread(target=burn, name="census-burner")
    thread.start()
    thread.join()
    delta = census.cpu_delta(before, census.thread_cpu())
    assert seen["affinity"]["census-burner"] == [f"{cpu}-{cpu}"]  # type: ignore[index]
    assert list(delta.values()) == sorted(delta.values(), reverse=True)  # busiest first


def test_live_threads_are_counted_by_name() -> None:
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=burn, name="census-live")
    before = census.thread_cpu()
    thread.start()
    time.sleep(0.4)
    after = census.thread_cpu()
    stop.set()
    thread.join()
    assert census.cpu_delta(before, after).get("census-live", 0.0) >= 0.1


def test_the_collector_census_counts_what_it_tracks() -> None:
    class Marker:
        pass

    keep = [Marker() for _ in range(5000)]
    out = census.gc_census(top=50)
    assert out["types"].get("Marker", 0) >= 5000 and out["objects"] >= 5000
    assert len(out["passes"]) == 3 and census.rss_mib() > 0
    del keep


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_threads_allowed_on_names_the_other_threads_allowed_on_a_core() -> None:
    import threading

    first, second = sorted(os.sched_getaffinity(0))[:2]
    ready, stop = threading.Event(), threading.Event()

    def pinned() -> None:
        os.sched_setaffinity(0, {second})
        ready.set()
        stop.wait(10)

    t = threading.Thread(target=pinned)
    t.start()
    ready.wait(10)
    try:
        # the pinned thread is allowed on the second core only; the caller is never counted
        assert len(census.threads_allowed_on(first)) == len(census.threads_allowed_on(second)) - 1
    finally:
        stop.set()
        t.join()
