"""bench/timeline_table.py: engine steps of a torch.profiler trace, first-token steps apart."""

from __future__ import annotations

from typing import Any

from tests.scripts._load import load_script

table_mod = load_script("bench/timeline_table.py")

ENGINE, SAVER = 10, 11


def _x(name: str, ts: float, dur: float, cat: str = "user_annotation", tid: int = ENGINE,
       **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "args": args}


def _trace() -> list[dict[str, Any]]:
    """Two steps of 10 ms: step 5 gives a first token and captures a save; step 6 decodes."""
    return [
        _x("ProfilerStep#5", 0, 10_000), _x("ProfilerStep#6", 10_000, 10_000),
        _x("gpu_model_runner: forward", 1_000, 6_000), _x("mcv:wait_for_save", 6_000, 1_000),
        _x("gpu_model_runner: forward", 11_000, 5_000), _x("mcv:wait_for_save", 15_000, 100),
        # vLLM's stream 7: two overlapping kernels count once; a kernel across the boundary splits
        _x("k1", 1_000, 4_000, "kernel", stream=7), _x("k2", 3_000, 3_000, "kernel", stream=7),
        _x("k3", 9_000, 2_000, "kernel", stream=7),
        _x("Memcpy DtoH (Device -> Pinned)", 8_000, 500, "gpu_memcpy", stream=7),
        # our save stream 9: a gather and its copy to the host
        _x("index_select", 6_500, 500, "kernel", stream=9),
        _x("Memcpy DtoH (Device -> Pinned)", 7_000, 2_000, "gpu_memcpy", stream=9),
        _x("cudaEventSynchronize", 7_000, 2_000, "cuda_runtime", tid=SAVER),
        _x("cudaLaunchKernel", 6_100, 10, "cuda_runtime"),
        _x("not ours", 0, 5_000, "user_annotation", tid=SAVER),  # another thread's range
    ]


def test_steps_split_by_first_tokens_with_scopes_hooks_and_gpu_per_stream() -> None:
    out = table_mod.summarize(_trace(), first_steps=[5, 99])
    assert out["vllm_stream"] == 7 and out["steps"] == 2
    first, other = out["first_token"], out["other"]
    assert first["n"] == 1 and other["n"] == 1
    assert first["step"] == 10.0 and first["gpu_model_runner: forward"] == 6.0
    assert first["mcv hooks"] == 1.0 and other["mcv:wait_for_save"] == 0.1
    # stream 7 in step 5: [1, 6] ms + [9, 10] ms + the copy [8, 8.5] ms = 6.5 ms
    assert first["gpu vllm stream"] == 6.5 and other["gpu vllm stream"] == 1.0
    assert first["gpu other streams"] == 2.5 and first["other DtoH"] == 2.0
    assert first["vllm DtoH"] == 0.5 and "vllm DtoH" not in other
    calls = out["cuda_calls_ms"]
    assert calls[f"tid {SAVER}"]["cudaEventSynchronize"] == [1, 2.0]
    assert calls["engine"]["cudaLaunchKernel"] == [1, 0.01]


def test_a_trace_without_steps_says_so() -> None:
    assert "error" in table_mod.summarize([_x("k", 0, 1, "kernel", stream=1)], [])
