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


class _FakeEngine:
    """Two new tokens per request per step once a request has waited ``delay`` steps."""

    def __init__(self, delay: dict[str, int]) -> None:
        self.delay, self.waited, self.left = delay, {}, {}

    def add_request(self, rid: str, prompt: object, params: object) -> None:
        self.waited[rid], self.left[rid] = 0, params.max_tokens  # type: ignore[attr-defined]

    def step(self) -> list[object]:
        from types import SimpleNamespace

        outs = []
        for rid in list(self.left):
            self.waited[rid] += 1
            if self.waited[rid] < self.delay[rid]:
                continue
            n = min(2, self.left[rid])
            self.left[rid] -= n
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            outs.append(SimpleNamespace(request_id=rid, finished=done, num_cached_tokens=0,
                                        outputs=[SimpleNamespace(token_ids=[7] * n)]))
        return outs


def test_serve_counts_the_engine_steps_each_request_waited_for_its_first_token() -> None:
    """Mixed serving's TTFT p50 rose by 9 ms with saves on: the step counts tell more steps
    from longer ones. The second client's requests start after the first's ended."""
    reqs = [steps_mod.Req(rid, [1, 2, 3], 4) for rid in ("a", "b", "c")]
    steps_mod.serve(_FakeEngine({"a": 1, "b": 3, "c": 2}), reqs, clients=2, detokenize=False)
    assert [r.ttft_steps() for r in reqs] == [1, 3, 2]
    assert reqs[2].step_add == 2  # added when "a" finished, after the second step
    assert steps_mod.Req("x", [1], 1).ttft_steps() == -1  # never served
