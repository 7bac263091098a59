"""bench/bench_routing.py: where each instance computes."""

from __future__ import annotations

import os

import pytest

from tests.scripts._load import load_script

bench_routing = load_script("bench/bench_routing.py")


def test_cpu_share_leaves_every_instance_one_unbound_thread() -> None:
    envs = [bench_routing._compute({"cpu_share": True}, i) for i in range(3)]
    assert envs == [{"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}] * 3


def test_by_default_each_instance_is_bound_to_a_core_round_robin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    envs = [bench_routing._compute({}, i) for i in range(len(cores) + 1)]
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs] == [str(c) for c in cores] + [str(cores[0])]
