"""The claim policy's prefill and load models (v1/claim_models.py): fed made-up samples."""

from __future__ import annotations

import pytest

from mooncake_vllm.v1.claim_models import LoadModel, PrefillModel
from tests.v1.claim_samples import Clock, loads, prefill_steps


def test_models_recover_what_they_were_fed() -> None:
    clock = Clock()
    pm = PrefillModel(60.0)
    for m, w, reach, s in prefill_steps():
        pm.add(clock(), m, w, s, reach)
    assert len(pm.samples) == 7 and pm.reach == 32768  # the decode step is not a prefill sample
    c0, c1, c2 = pm.coefficients(clock())  # type: ignore[misc]
    assert c0 == pytest.approx(0.01, rel=1e-3) and c1 == pytest.approx(2e-5, rel=1e-3)
    assert c2 == pytest.approx(1e-9, rel=1e-3)
    assert pm.recompute(clock(), 0, 8192) == pytest.approx(2e-5 * 8192 + 1e-9 * 8192 * 4096)
    lm = LoadModel()
    for t, s in loads(100_000.0):  # l0 5 ms: a small load costs more per token
        lm.add(clock(), t, s)
    assert lm.seconds(10_000) == pytest.approx(0.005 + 0.1, rel=1e-3)
    lm.add(clock(), 2048, 5.0)  # one outlier moves nothing
    assert lm.seconds(10_000) == pytest.approx(0.005 + 0.1, rel=0.05)



def test_the_recompute_floor_is_the_model_within_reach_and_below_it_beyond() -> None:
    clock = Clock()
    pm = PrefillModel(60.0)
    for m, w, reach, sec in prefill_steps():
        if reach <= 8192:
            pm.add(clock(), m, w, sec, reach)
    assert pm.recompute_floor(clock(), 0, 8192) == pytest.approx(pm.recompute(clock(), 0, 8192))
    assert pm.recompute_floor(clock(), 1024, 4096) == pytest.approx(pm.recompute(clock(), 1024, 4096))
    for start, end in ((0, 16384), (4096, 32768), (12000, 16000)):
        floor, model = pm.recompute_floor(clock(), start, end), pm.recompute(clock(), start, end)
        assert floor is not None and model is not None and 0 < floor < model
    # the floor prices each token past the reach at the cost of the token at the reach
    _, c1, c2 = pm.coefficients(clock())  # type: ignore[misc]
    assert pm.recompute_floor(clock(), 8192, 9192) == pytest.approx(1000 * (c1 + c2 * 8192))



def test_chunks_of_one_size_still_measure_the_per_token_cost() -> None:
    """vLLM prefills a long prompt in max_num_batched_tokens chunks: every prefill sample has
    the same size, so an intercept fitted to them alone would swallow the per-token cost (and
    the H200 run declined 16k hits that loaded in 0.27 s against a 0.48 s recompute)."""
    clock = Clock()
    pm = PrefillModel(60.0)
    c0, c1, c2 = 0.012, 2.1e-5, 9e-10
    for p in (0, 8192) * 6:
        w = 8192 * (p + 4096)
        pm.add(clock(), 8192, w, c0 + c1 * 8192 + c2 * w, p + 8192)
    for _ in range(20):
        pm.add(clock(), 1, 4000, c0 + c1 + c2 * 4000, 0)  # decodes
    truth = c1 * 16000 + c2 * 16000 * 8000
    assert pm.recompute(clock(), 0, 16000) == pytest.approx(truth, rel=0.02)
    assert pm.step(clock()) == pytest.approx(c0, rel=0.01)



def test_warm_up_prompts_of_one_length_give_a_per_token_cost_not_a_degenerate_fit() -> None:
    """The H200 reader served three 2k prompts first: both columns of such samples are
    proportional, and the fit priced a 1k recompute at 0.3 ms (every hit declined), then, with
    one 1k step beside them, a negative per-token cost (no model: every hit claimed blind)."""
    clock = Clock()
    pm = PrefillModel(60.0)
    for _ in range(20):
        pm.add(clock(), 1, 100, 0.0259)  # decodes: c0
    for s in (0.0508, 0.0431, 0.0429):
        pm.add(clock(), 2048, 2048 * 1024, s, 2048)
    per_token = (0.0456 - 0.0259) / 2048
    assert pm.recompute(clock(), 0, 1008) == pytest.approx(per_token * 1008, rel=0.1)
    pm.add(clock(), 1024, 1024 * 512, 0.0298, 1024)  # strong curvature: c1 would be < 0
    coef = pm.coefficients(clock())
    assert coef is not None and coef[1] == 0.0 and coef[2] > 0
    short, long = pm.recompute(clock(), 0, 1008), pm.recompute(clock(), 0, 2048)
    assert short is not None and long is not None and 0 < short < long
    assert long == pytest.approx(0.0197, rel=0.25)  # what the 2k steps took above c0
