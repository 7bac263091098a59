"""bench/pooled_ratios.py: mixed serving against none, pooled over runs with a median interval."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.scripts._load import load_script

pooled = load_script("bench/pooled_ratios.py")


def _table(none: list[float], **modes: list[float]) -> dict[str, Any]:
    def row(tok: list[float]) -> dict[str, Any]:
        return {"mixed": {"throughput_by_rep": {str(i): t for i, t in enumerate(tok)}}}
    return {"none": row(none), **{m: row(t) for m, t in modes.items()}}


def test_the_interval_is_the_sign_tests_order_statistics() -> None:
    xs = [float(x) for x in range(1, 9)]  # n=8: P(B<2) = 9/256 <= 0.05, P(B<3) = 37/256 > 0.05
    assert pooled.median_interval(xs, 0.9) == (2.0, 7.0)
    assert pooled.median_interval(list(reversed(xs)), 0.9) == (2.0, 7.0)
    assert pooled.median_interval([1.0, 2.0, 3.0], 0.9) is None  # too few for 90 %
    assert pooled.median_interval([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == (1.0, 5.0)
    with pytest.raises(ValueError, match="conf"):
        pooled.median_interval(xs, 1.0)


def test_the_interval_covers_the_median_as_often_as_it_says() -> None:
    rng = random.Random(7)
    covered = 0
    for _ in range(2000):
        sample = [rng.lognormvariate(0.0, 0.3) for _ in range(16)]  # true median 1.0
        lo, hi = pooled.median_interval(sample, 0.9)
        covered += lo <= 1.0 <= hi
    assert covered / 2000 >= 0.89


def test_runs_pool_their_paired_reps_and_say_how_far_none_spread() -> None:
    a = _table([100.0, 125.0, 75.0, 100.0], ours=[95.0, 118.0, 72.0, 94.0])
    b = _table([100.0, 101.0, 99.0, 100.0], ours=[96.0, 97.0, 94.0, 95.0], noop=[100.0] * 4)
    out = pooled.pool({"a": a, "b": b}, conf=0.9)
    assert out["runs"]["a"]["none_spread"] == [-0.25, 0.25]
    assert out["runs"]["b"]["none_spread"] == [-0.01, 0.01]
    ratios = [95 / 100, 118 / 125, 72 / 75, 94 / 100, 96 / 100, 97 / 101, 94 / 99, 95 / 100]
    assert out["pooled"]["ours"]["pairs"] == 8
    assert out["pooled"]["ours"]["median"] == round(statistics.median(ratios), 3)
    lo, hi = out["pooled"]["ours"]["interval"]
    assert lo == round(sorted(ratios)[1], 3) and hi == round(sorted(ratios)[6], 3)
    assert out["pooled"]["noop"]["pairs"] == 4 and out["pooled"]["noop"]["interval"] is None


def test_the_command_line_reads_driver_jsons(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"table": _table([10.0] * 6, ours=[9.0] * 6)}))
    assert pooled.main([str(path), "--json", str(tmp_path / "out.json")]) == 0
    assert "pooled ours: median 0.9 over 6 pairs" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["pooled"]["ours"]["median"] == 0.9
