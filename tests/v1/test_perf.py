"""The worker's step and load timings for the claim policy (host clock; CUDA events on the GPU)."""

from __future__ import annotations

import pytest

from mooncake_vllm.v1.claim_models import MIN_FIT, MIN_PREFILL
from mooncake_vllm.v1.metrics import PoolStats
from mooncake_vllm.v1.perf import DECODE_EVERY, MAX_PENDING, SLOW_FAILURE, StepTimer


class Clock:
    now = 10.0

    def __call__(self) -> float:
        return self.now


def test_steps_are_timed_from_start_load_kv_to_wait_for_save() -> None:
    clock = Clock()
    t = StepTimer(clock=clock)
    assert t.take() is None
    t.step_began((512.0, 2048.0))
    clock.now += 0.25
    t.step_ended()
    t.step_began(None)  # a step with no work to time (no metadata)
    t.step_ended()
    t.step_began((0.0, 0.0))  # nothing scheduled
    t.step_ended()
    t.load_done(512, 0.5)
    t.load_done(512, 0.1, loaded=0)  # failed fast: says nothing about speed
    t.load_done(512, SLOW_FAILURE + 1, loaded=256)  # failed slowly: a slow pool
    assert t.take() == {"steps": [[512.0, 2048.0, 0.25]],
                        "loads": [[512.0, 0.5], [512.0, SLOW_FAILURE + 1]]}
    assert t.take() is None


def test_samples_are_bounded_between_reports() -> None:
    t = StepTimer(clock=Clock(), decode_every=1)
    for _ in range(MAX_PENDING + 10):
        t.load_done(16, 0.01)
        t.step_began((1.0, 1.0))
        t.step_ended()
    got = t.take()
    assert got is not None and len(got["loads"]) == MAX_PENDING and len(got["steps"]) == MAX_PENDING


def test_steps_that_teach_the_policy_nothing_are_not_timed() -> None:
    """Prefill steps it fits are all timed, one decode step in DECODE_EVERY, and none between."""
    clock = Clock()
    t = StepTimer(clock=clock)
    for tokens in [16.0] * (2 * DECODE_EVERY) + [MIN_PREFILL, MIN_FIT - 1, MIN_FIT, 8192.0]:
        t.step_began((tokens, tokens))
        clock.now += 0.01
        t.step_ended()
    got = t.take()
    assert got is not None
    assert [s[0] for s in got["steps"]] == [16.0, 16.0, MIN_FIT, 8192.0]


def test_perf_samples_travel_in_pool_stats_and_add_up_over_workers() -> None:
    a = PoolStats(data={"counters": {}, "latency": {}, "pool_up": {},
                        "perf": {"steps": [[1.0, 1.0, 0.1]], "loads": []}})
    b = PoolStats(data={"counters": {"loaded_blocks": 1}, "latency": {}, "pool_up": {},
                        "perf": {"loads": [[16.0, 0.2]]}})
    assert not a.is_empty()
    a.aggregate(b)
    assert a.data["perf"] == {"steps": [[1.0, 1.0, 0.1]], "loads": [[16.0, 0.2]]}
    assert "perf" not in "".join(a.reduce())  # vLLM's log line shows counters only


@pytest.mark.gpu
def test_cuda_steps_are_gpu_time_read_once_the_events_completed() -> None:
    import torch

    t = StepTimer(cuda_device=torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    t.step_began((8.0, 8.0))
    for _ in range(20):
        x = x @ x / 4096
    t.step_ended()
    torch.cuda.synchronize()
    got = t.take()
    assert got is not None and len(got["steps"]) == 1 and got["steps"][0][2] > 0
