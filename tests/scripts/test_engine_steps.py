"""bench/engine_steps.py: the hook timer the serving benches wrap a connector class with."""

from __future__ import annotations

import threading

from tests.scripts._load import load_script

steps_mod = load_script("bench/engine_steps.py")


def _busy_inside_the_hook() -> int:
    return sum(range(2000))


def _busy_outside_any_hook() -> int:
    return sum(range(2000))


class _Connector:
    def wait_for_save(self) -> int:
        return _busy_inside_the_hook()

    def get_finished(self, done: set[str]) -> tuple[set[str], None]:
        return done, None


def test_hooks_are_timed_and_profiled_only_inside_them_on_every_thread() -> None:
    timer = steps_mod.HookTimer()
    cls = type("Connector", (_Connector,), {})
    timer.install(cls)
    timer.install(cls)  # twice: wrapped once
    conn = cls()
    conn.wait_for_save()
    assert timer.take_profile() == ""  # profiling off: nothing collected
    timer.profile = True
    conn.wait_for_save()
    assert conn.get_finished({"r1"}) == ({"r1"}, None)  # arguments and results pass through
    _busy_outside_any_hook()
    worker = threading.Thread(target=conn.wait_for_save)
    worker.start()
    worker.join()
    totals = timer.take()
    assert totals["wait_for_save"][0] == 3 and totals["get_finished"][0] == 1
    assert all(seconds > 0 for _, seconds in totals.values())
    assert timer.take() == {}  # taken: reset
    text = timer.take_profile()
    assert "_busy_inside_the_hook" in text and "_busy_outside_any_hook" not in text
    # ncalls of the profiled hook's callee: this thread's and the other's, added up
    assert {line.split()[0] for line in text.splitlines() if "_busy_inside_the_hook" in line} == {"2"}
    assert timer.take_profile() == ""  # taken: reset
