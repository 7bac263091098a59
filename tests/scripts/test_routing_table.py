"""bench/routing_table.py: two routing policies compared over many bench_routing.py runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.scripts._load import load_script

ROOT = Path(__file__).resolve().parents[2]
table_mod = load_script("bench/routing_table.py")


def _run(ttfts: list[float], per_s: float, loads: list[int] | None = None) -> dict[str, Any]:
    loads = loads or [0] * len(ttfts)
    return {"requests_per_s": per_s, "ttft_p99_s": max(ttfts), "request_log": [
        {"turn": i % 2, "ttft_s": t, "instance": 0, "loads": [n, 9]} for i, (t, n) in enumerate(zip(ttfts, loads))]}


def test_a_policy_that_starves_a_few_wins_the_p50_and_loses_the_mean() -> None:
    report = {"runs": {
        "prefix": _run([0.1, 0.1, 0.1, 9.0], 1.0), "prefix#2": _run([0.1, 0.2, 0.1, 7.0], 1.2),
        "kv_aware": _run([0.3, 0.3, 0.3, 0.4], 1.5), "round_robin": _run([5.0], 0.5)}}
    row = table_mod.per_run(report, ("prefix", "kv_aware"))
    assert row["prefix"][0] == pytest.approx((0.1 + 0.15) / 2) and row["kv_aware"][0] == pytest.approx(0.3)
    assert row["prefix"][1] == pytest.approx((2.325 + 1.85) / 2)  # the medians of the repeats' means
    assert row["kv_aware"][1] == pytest.approx(0.325) and row["kv_aware"][2] == 0.4 and row["kv_aware"][3] == 1.5
    assert table_mod.per_run(report, ("prefix", "least_loaded")) is None


def test_later_turns_are_grouped_by_the_load_of_their_instance_at_pick() -> None:
    reports = [{"runs": {"kv_aware": _run([1.0, 0.2, 1.0, 0.4, 1.0, 3.0, 1.0, 5.0], 1.0,
                                          loads=[0, 0, 0, 1, 0, 4, 0, 7]),
                         "prefix": _run([1.0, 9.0], 1.0)}}]
    # turn 0 (even indexes) is left out; 4 and 7 in flight are both "4 or more"
    assert table_mod.by_load_at_pick(reports, "kv_aware") == {0: (1, 0.2), 1: (1, 0.4), 4: (2, 4.0)}


def test_later_turns_split_by_whether_another_instance_was_idle_at_pick() -> None:
    log = [{"turn": 1, "ttft_s": t, "instance": 0, "loads": loads} for t, loads in
           [(0.2, [1, 0, 3]), (0.4, [1, 2, 3]), (0.6, [1, 2, 3]), (2.0, [5, None, 1]), (0.1, [0, 0, 0])]]
    log.append({"turn": 0, "ttft_s": 9.0, "instance": 0, "loads": [1, 0, 0]})  # first turns are left out
    assert table_mod.load_at_pick(log, idle_elsewhere=True) == {
        (0, True): (1, 0.1), (1, False): (2, 0.5), (1, True): (1, 0.2), (4, True): (1, 2.0)}


def test_main_prints_a_row_per_run_and_the_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench_routing-x.json"
    path.write_text(json.dumps({"runs": {"prefix": _run([0.1, 0.1, 9.0], 1.0),
                                         "kv_aware": _run([0.3, 0.3, 0.4], 1.5)}}))
    assert table_mod.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "bench_routing-x" in out
    assert "kv_aware better than prefix in 1 runs: TTFT p50 0, TTFT mean 1, TTFT p99 1, req/s 1" in out
    assert "another instance idle / none idle" in out


def test_later_turns_split_by_what_was_prefilling_and_decoding_on_their_instance() -> None:
    """Requests in flight are not alike: one prefilling delays a new turn more than one decoding."""
    def entry(turn: int, sent: float, ttft: float, latency: float | None, instance: int = 0) -> dict[str, Any]:
        return {"turn": turn, "sent_s": sent, "ttft_s": ttft, "latency_s": latency, "instance": instance,
                "pick_s": 0.01, "loads": [0, 0]}

    log = [entry(0, 0.0, 1.0, 3.0),            # prefilling until 1.0, decoding until 3.0
           entry(1, 0.5, 0.7, 1.0),            # picked at 0.51: one prefilling
           entry(1, 2.0, 0.2, 2.5),            # picked at 2.01: one decoding (the first), the 0.5 one ended
           entry(1, 2.0, 0.3, 2.5, instance=1),  # another instance: nothing on it
           entry(1, 9.0, 5.0, None)]           # no latency_s (an older log): left out
    assert table_mod.phases_at_pick([log]) == {(0, 0): (1, 0.3), (0, 1): (1, 0.2), (1, 0): (1, 0.7)}
    # a second run's log: its clock starts again, and its requests do not overlap the first's
    assert table_mod.phases_at_pick([log, [entry(1, 0.5, 0.4, 1.0)]])[0, 0] == (2, 0.35)
