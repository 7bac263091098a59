"""bench/bench_lookup_cost.py: the scheduler's lookup hook timed per prefix length."""

from __future__ import annotations

from tests.scripts._load import load_script

bench = load_script("bench/bench_lookup_cost.py")


def test_it_times_the_hook_for_a_prefix_vllm_holds_and_names_where_the_time_goes() -> None:
    row = bench.measure(256, block_size=16, requests=4)
    assert row["chunks"] == 16 and row["lookup_us"] > 0 and row["request_finished_us"] > 0
    assert any("_chain" in name for name in row["lookup_top_own_us"])  # the digests are hashed

