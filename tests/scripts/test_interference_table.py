"""bench/interference_table.py: the summary of bench_gpu_interference.py's raw runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.scripts._load import load_script

ROOT = Path(__file__).resolve().parents[2]
table_mod = load_script("bench/interference_table.py")


def _rep(tok_s: float, wall: float, p99: float) -> dict[str, Any]:
    return {"throughput_tok_s": tok_s, "wall_s": wall, "ttft_p50_s": 0.05, "ttft_p99_s": p99,
            "itl_p99_s": 0.02, "steps": {"n": 100, "sum_s": 2.0, "p50_s": 0.02, "p99_s": 0.1}}


def test_a_mixed_phase_run_alone_still_makes_its_table() -> None:
    """A mixed-only run (no measure phase) gave an empty table: every ratio was lost."""
    report = {"writers": {}, "runs": {
        "none": {"ready": {}, "mixed_reps": [_rep(1000.0, 4.0, 0.40), _rep(1000.0, 4.0, 0.44)]},
        "ours": {"ready": {}, "mixed_reps": [_rep(900.0, 4.0, 0.44), _rep(1100.0, 4.0, 0.48),
                                             {**_rep(10.0, 9.0, 9.0), "profiled": True}]}}}
    table = table_mod.derive(report)
    assert table["none"]["mixed"]["throughput_tok_s"] == 1000.0
    assert table["ours"]["mixed"]["reps"] == 2  # the py-spy rep left out
    assert table["pool_ratios"]["ours"] == {"mixed_throughput_vs_none": 1.0,
                                            "mixed_ttft_p99_vs_none": round(0.46 / 0.42, 3)}


def test_a_mode_without_any_phase_has_no_row() -> None:
    report = {"writers": {}, "runs": {"none": {"ready": {}}, "ours": {"ready": {}, "measure": {"error": "x"}}}}
    assert table_mod.derive(report) == {}


def test_mixed_reps_are_also_compared_pairwise_by_rep() -> None:
    """Interleaved reps drift together: each rep's ratio against none's same rep, medians."""
    def reps(*tok_s: float) -> list[dict[str, Any]]:
        return [{**_rep(t, 4.0, 0.4), "rep": i} for i, t in enumerate(tok_s)]

    report = {"writers": {}, "runs": {
        "none": {"ready": {}, "mixed_reps": reps(1000.0, 800.0, 1200.0, 900.0)},
        "ours": {"ready": {}, "mixed_reps": reps(500.0, 760.0, 1200.0, 990.0)}}}
    ratios = table_mod.derive(report)["pool_ratios"]["ours"]
    assert ratios["mixed_paired_median_vs_none"] == round((0.95 + 1.0) / 2, 3)  # 0.5, .95, 1, 1.1
    assert ratios["mixed_paired_median_vs_none_reps1"] == 1.0  # 0.95, 1.0, 1.1


def test_a_reference_writer_without_a_length_compares_only_the_lengths_it_wrote() -> None:
    """The in-tree writer skips hits past --intree-max-len: with it the only writer (modes
    none,intree at 32k, the H100 of 2026-12-06) the table raised KeyError '32000'."""
    def measure(lengths: tuple[str, ...], tokens: list[int]) -> dict[str, Any]:
        stat = {"p50": 0.01, "p99": 0.02, "max": 0.03, "n": 5}
        return {"alone": stat, "during_load": stat, "load": {"ttft_s": 0.2, "cached": 0, "tokens": [1]},
                "hits": {n: [{"ttft_s": 0.05, "cached": 0, "tokens": tokens, "again_tokens": tokens}]
                         for n in lengths}}

    report = {"writers": {"intree": {"write": {"tokens": {"load": [1], "hits": {"2048": [[7]]}}}}},
              "runs": {"none": {"ready": {}, "measure": measure(("2048", "32000"), [7])}}}
    row = table_mod.derive(report)["none"]
    assert row["hit2048_tokens_equal_recompute"] == [True]
    assert "hit32000_tokens_equal_recompute" not in row
    assert row["hit32000_ttft_ms"] == [50.0]


def test_mixed_reps_count_the_engine_steps_to_each_first_token() -> None:
    report = {"writers": {}, "runs": {"ours": {"ready": {}, "mixed_reps": [
        {**_rep(900.0, 4.0, 0.4), "ttft_steps": [2, 3, 2, -1]}, {**_rep(900.0, 4.0, 0.4), "ttft_steps": [4]}]}}}
    row = table_mod.derive(report)["ours"]["mixed"]
    assert row["ttft_steps_count"] == {"2": 2, "3": 1, "4": 1}  # -1 (never served) left out
    assert row["ttft_steps_mean"] == 2.75
