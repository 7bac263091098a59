"""bench/put_interference.py: its table, and its putter against a real pool."""

from __future__ import annotations

import time

import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store.connect import open_store
from tests.scripts._load import load_script

probe = load_script("bench/put_interference.py")


def _cond(name: str, rnd: int, steps: list[float], nbytes: int = 0) -> dict[str, object]:
    return {"name": name, "round": rnd, "seconds": 2.0, "steps_ms": steps, "bytes": nbytes}


def test_each_condition_is_compared_with_the_quiet_of_its_own_round() -> None:
    summary = probe.summarize([
        _cond("quiet", 0, [10.0, 10.0, 10.0]), _cond("threads@400", 0, [20.0, 20.0, 30.0], 800_000_000),
        _cond("quiet", 1, [5.0, 5.0, 5.0]), _cond("threads@400", 1, [5.0, 6.0, 7.0], 800_000_000)])
    rounds = summary["threads@400"]["rounds"]
    assert [r["vs_quiet"] for r in rounds] == [2.0, 1.2]
    assert summary["threads@400"]["vs_quiet_median"] == 1.6
    assert [r["mean_vs_quiet"] for r in rounds] == [2.333, 1.2]  # the slow step counts here
    assert summary["threads@400"]["vs_quiet_mean"] == 1.767
    assert rounds[0]["MBps"] == 400.0 and rounds[0]["p90_ms"] == 20.0
    assert summary["quiet"]["vs_quiet_median"] == 1.0


def test_the_putter_keeps_its_rate_and_leaves_the_pool_as_found(
        module_local_stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(module_local_stack.config_path))
    putter = probe._Putter("test")
    reader = open_store(load_store_config(module_local_stack.config_path), timeout=10).store
    try:
        rate = 40e6
        start = time.perf_counter()
        put = putter.run("rate", 0.5, rate)
        took = time.perf_counter() - start
        assert took >= 0.5
        assert 0.5 * rate <= put <= 0.6 * rate + probe.BATCH * probe.BLOCK  # paced, not flat out
        assert reader.is_exist("put-interference/rate/test/0/0") != 1  # removed after the run
        assert putter.run("kept", 0.01, rate) > 0
        assert reader.is_exist("put-interference/kept/test/0/0") != 1
        assert putter.store.put("put-interference/control", b"x") == 0
        assert reader.is_exist("put-interference/control") == 1  # the check can see a key
        putter.store.remove("put-interference/control")
    finally:
        reader.close()
        putter.store.close()


def test_interrupts_reads_one_cpus_column_of_the_ipi_rows() -> None:
    text = ("           CPU0       CPU1\n"
            "  0:         10          0   IO-APIC   2-edge      timer\n"
            "RES:        300        400   Rescheduling interrupts\n"
            "CAL:         50         60   Function call interrupts\n"
            "TLB:          7          9   TLB shootdowns\n")
    assert probe.interrupts(1, text) == {"RES": 400, "CAL": 60, "TLB": 9}
    assert probe.interrupts(5, text) == {}  # no such CPU


def _paced_steps(run: object, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        run.between_steps()  # type: ignore[attr-defined]
        time.sleep(0.005)  # the rest of an engine step


def test_our_saves_are_captured_by_the_stepping_thread_and_put_or_handed_back_by_another(
        module_local_stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(module_local_stack.config_path))
    saver = probe._OursSaver(2, "cpu")
    try:
        assert saver.client.lanes == 2
        block, rate = saver.layout.block_nbytes, 40e6
        put = saver.start("rate", rate, put=True)
        _paced_steps(put, 0.5)
        assert put.thread.is_alive() and put.thread.name == "mcv-save"
        assert saver.client.exists(["put-interference-ours/rate/0/0"]) == [True]  # really put
        stored = put.finish()
        assert 0.5 * rate <= stored <= 0.5 * rate + 2 * saver.BLOCKS * block  # paced, not flat out
        assert stored == put.captured * saver.BLOCKS * block  # every capture was put
        assert saver.client.exists(["put-interference-ours/rate/0/0"]) == [False]  # removed
        held = saver.start("held", rate, put=False)
        _paced_steps(held, 0.2)
        assert held.finish() == held.captured * saver.BLOCKS * block > 0
        assert saver.client.exists(["put-interference-ours/held/0/0"]) == [False]  # never put
        assert saver.client.put_blocks(["put-interference-ours/control"], saver.layout, [0]) == 1
        assert saver.client.exists(["put-interference-ours/control"]) == [True]  # the check sees keys
    finally:
        saver.client.remove_matching("put-interference-ours/.*")
        saver.client.close()


def test_in_process_excess_sets_each_in_process_mover_against_its_pair() -> None:
    summary = {"quiet": {"vs_quiet_median": 1.0}, "threads@400": {"vs_quiet_median": 1.2},
               "procs@400": {"vs_quiet_median": 1.1}, "ours@400": {"vs_quiet_median": 1.5},
               "capture@400": {"vs_quiet_median": 1.25, "vs_quiet_mean": 1.6},
               "copy@400": {"vs_quiet_median": 1.1}, "threads@1600": {"vs_quiet_median": 2.0}}
    summary["ours@400"]["vs_quiet_mean"] = 2.0
    assert probe.in_process_excess(summary) == {
        "400": {"threads/procs": 1.091, "procs": 1.1, "ours/capture": 1.2, "mean:ours/capture": 1.25}}
