"""services.external: the pieces of starting vLLM CPU servers that are pure logic."""

from __future__ import annotations

import os

import pytest

from mooncake_vllm.services import cpu_binding


def test_cpu_binding_spreads_instances_over_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    got = [cpu_binding(i)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(2 * len(cores))]
    assert got == [str(c) for c in cores] * 2  # each core once before any twice


def test_cpu_binding_leaves_a_users_binding_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert cpu_binding(3) == {}
