"""The pool's threads off vLLM's cores or below its priority: real threads, real priorities."""

from __future__ import annotations

import os
import threading

import pytest

from mooncake_vllm import placement
from mooncake_vllm.errors import ConfigError
from mooncake_vllm.placement import (
    DEFAULT_NICE,
    THREAD_AFFINITY_ENV,
    THREAD_NICE_ENV,
    note_compute_cores,
    off_compute_cores,
    thread_affinity,
    thread_nice,
)
from mooncake_vllm.store.timebox import TimeBox

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


@pytest.fixture(autouse=True)
def _undecided(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test decides afresh (the process's decision is made once)."""
    monkeypatch.setattr(placement, "_decided", None)


def _placed(cores: set[int]) -> tuple[int, set[int], int]:
    """Nice before, affinity after and nice after ``off_compute_cores`` in a fresh thread on ``cores``."""
    out: list[object] = []

    def run() -> None:
        tid = threading.get_native_id()
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:
            out.append(exc)
            return
        before = os.getpriority(os.PRIO_PROCESS, tid)
        off_compute_cores()
        out.extend([before, os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, tid)])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if isinstance(out[0], OSError):
        pytest.skip(f"cannot set this thread's affinity here: {out[0]}")
    return out[0], out[1], out[2]  # type: ignore[return-value]


def _all_cores() -> set[int]:
    return set(os.sched_getaffinity(0))


def test_sharing_every_core_runs_the_thread_below_its_creator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREAD_NICE_ENV, raising=False)
    monkeypatch.delenv(THREAD_AFFINITY_ENV, raising=False)
    if set(range(os.cpu_count() or 1)) != _all_cores():
        pytest.skip("this process may not run on every core: no thread can share all of them")
    before, cores, after = _placed(_all_cores())
    assert cores == _all_cores()
    assert after == min(19, before + DEFAULT_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # only that thread


def test_a_spare_core_moves_the_thread_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREAD_NICE_ENV, raising=False)
    cores = _all_cores()
    if len(cores) < 2 or set(range(os.cpu_count() or 1)) != cores:
        pytest.skip("needs two cores this process may use")
    compute = min(cores)
    before, placed, after = _placed({compute})
    assert placed == cores - {compute} and after == before


def test_the_threads_never_leave_the_cores_the_process_was_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``taskset -c 4-7 vllm serve``: vLLM computes on all four given cores; the pool's
    threads stay on them, below its priority, not on cores the operator kept from it."""
    monkeypatch.delenv(THREAD_NICE_ENV, raising=False)
    monkeypatch.delenv(THREAD_AFFINITY_ENV, raising=False)
    cores = _all_cores()
    if len(cores) < 2:
        pytest.skip("needs two cores this process may use")
    given = frozenset({min(cores)})
    monkeypatch.setattr(placement, "_process_cpus", given)
    before, placed, after = _placed(set(given))
    assert placed == given  # not moved to the cores the process was not given
    assert after == min(19, before + DEFAULT_NICE)


def test_the_other_cores_are_the_given_ones_vllm_does_not_compute_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREAD_AFFINITY_ENV, raising=False)
    cores = sorted(_all_cores())
    if len(cores) < 3:
        pytest.skip("needs three cores this process may use")
    monkeypatch.setattr(placement, "_process_cpus", frozenset(cores[:2]))  # given two of them
    before, placed, after = _placed({cores[0]})  # vLLM pinned its worker to one
    assert placed == {cores[1]} and after == before  # the other given core, not cores[2:]


def test_an_openmp_binding_means_the_first_thread_may_already_be_narrowed() -> None:
    """vLLM's CPU backend starts each worker with GOMP_CPU_AFFINITY: torch's OpenMP runtime
    pins the worker's first thread when it loads, before the plugin notes anything — the
    spare cores are then counted from every core, or the pool's threads would share the
    compute core (the 1P1D fleet test's prefill lost its puts that way)."""
    every = frozenset(range(os.cpu_count() or 1))
    assert placement.process_cpus({}, frozenset({1})) == {1}  # taskset -c 1: honoured
    for name in placement.OMP_BINDINGS:
        assert placement.process_cpus({name: "0"}, frozenset({0})) == every
    assert placement.process_cpus({"GOMP_CPU_AFFINITY": ""}, frozenset({1})) == {1}


def test_the_process_cores_are_noted_when_vllm_loads_the_plugin() -> None:
    """The plugin entry point notes them: at vLLM's start, before a worker thread is pinned."""
    import subprocess
    import sys

    if len(_all_cores()) < 2:
        pytest.skip("needs two cores this process may use")
    code = ("import os; from mooncake_vllm.compat.registration import register; register(); "
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "  # vLLM pins its worker
            "import mooncake_vllm.placement as p; print(sorted(p._process_cpus))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.stdout.strip() == str(sorted(_all_cores())), got.stderr[-2000:]


@pytest.mark.parametrize("env", [{THREAD_NICE_ENV: "0"}, {THREAD_AFFINITY_ENV: "off"}])
def test_switched_off_leaves_priority_alone(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before, cores, after = _placed(_all_cores())
    assert after == before and cores == _all_cores()


def test_thread_nice_values() -> None:
    assert thread_nice({}) == DEFAULT_NICE
    assert thread_nice({THREAD_NICE_ENV: " 3 "}) == 3
    assert thread_nice({THREAD_NICE_ENV: "0"}) == 0
    for bad in ("20", "-1", "low", "1.5"):
        with pytest.raises(ConfigError) as err:
            thread_nice({THREAD_NICE_ENV: bad})
        assert err.value.fields == [THREAD_NICE_ENV] and repr(bad) in str(err.value)


def test_thread_affinity_values() -> None:
    assert thread_affinity({}) and thread_affinity({THREAD_AFFINITY_ENV: " On "})
    assert not thread_affinity({THREAD_AFFINITY_ENV: "off"})
    for bad in ("0", "false", "no", "of"):  # none of them may pass for off, or for on
        with pytest.raises(ConfigError) as err:
            thread_affinity({THREAD_AFFINITY_ENV: bad})
        assert err.value.fields == [THREAD_AFFINITY_ENV] and repr(bad) in str(err.value)


@pytest.mark.parametrize("name,value", [(THREAD_NICE_ENV, "99"), (THREAD_AFFINITY_ENV, "false")])
def test_the_connector_refuses_a_bad_value_at_start(monkeypatch: pytest.MonkeyPatch, name: str,
                                                    value: str) -> None:
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from mooncake_vllm.v1.connector import MooncakeStoreConnector

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        MooncakeStoreConnector(SimpleNamespace(), KVConnectorRole.WORKER)


def _in_thread(fn: object, cores: set[int] | None = None) -> object:
    """``fn()``'s value, run in a fresh thread (pinned to ``cores`` first, if given)."""
    out: list[object] = []

    def run() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        out.append(fn())  # type: ignore[operator]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def _two_cores() -> tuple[int, set[int]]:
    cores = _all_cores()
    if len(cores) < 2 or set(range(os.cpu_count() or 1)) != cores:
        pytest.skip("needs two cores this process may use")
    return min(cores), cores - {min(cores)}


def test_a_thread_started_by_a_moved_thread_stays_off_vllms_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The save thread starts its put workers; deciding again from its own CPUs would have
    sent them onto vLLM's (the split run on the H100, 2026-12-06: lane workers on 0-7)."""
    monkeypatch.delenv(THREAD_AFFINITY_ENV, raising=False)
    compute, others = _two_cores()

    def vllm_thread() -> object:
        note_compute_cores()

        def save_thread() -> object:
            off_compute_cores()
            mine = os.sched_getaffinity(0)

            def put_worker() -> object:
                off_compute_cores()
                return os.sched_getaffinity(0)

            return mine, _in_thread(put_worker)

        return _in_thread(save_thread)

    assert _in_thread(vllm_thread, {compute}) == (others, others)


def test_time_box_workers_started_from_vllms_thread_move_off_its_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup submitted on vLLM's thread starts the box's worker there; it moves."""
    monkeypatch.delenv(THREAD_AFFINITY_ENV, raising=False)
    compute, others = _two_cores()

    def vllm_thread() -> object:
        box = TimeBox("placement-test", 1)
        try:
            return box.run(10.0, lambda: os.sched_getaffinity(0))
        finally:
            box.close()

    assert _in_thread(vllm_thread, {compute}) == others


def test_lowered_once_whoever_starts_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharing every core: a thread started by one already lowered ends ``step`` below
    vLLM's, not twice that."""
    monkeypatch.setenv(THREAD_NICE_ENV, "4")
    monkeypatch.delenv(THREAD_AFFINITY_ENV, raising=False)
    if set(range(os.cpu_count() or 1)) != _all_cores():
        pytest.skip("this process may not run on every core: no thread can share all of them")
    tid = threading.get_native_id

    def vllm_thread() -> object:
        base = os.getpriority(os.PRIO_PROCESS, tid())
        note_compute_cores()

        def ours() -> object:
            off_compute_cores()
            return os.getpriority(os.PRIO_PROCESS, tid()), _in_thread(
                lambda: (off_compute_cores(), os.getpriority(os.PRIO_PROCESS, tid()))[1])

        return base, _in_thread(ours)

    base, (first, second) = _in_thread(vllm_thread)  # type: ignore[misc]
    assert first == second == min(19, base + 4)
