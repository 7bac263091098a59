"""bench/torch_timeline.py: a window of steps recorded under torch.profiler, gzipped."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.scripts._load import load_script

torch = pytest.importorskip("torch")
timeline = load_script("bench/torch_timeline.py")


def test_the_window_of_steps_is_recorded_as_numbered_ranges(tmp_path: Path) -> None:
    """Steps ``skip + WARMUP`` on are in the trace, each a ``ProfilerStep#N`` range named by its
    0-based step (what timeline_table.py joins with the requests' first-token steps)."""

    def serve(after_step: object) -> None:
        for _ in range(12):
            with torch.profiler.record_function("mcv:wait_for_save"):
                torch.ones(64).sum()
            after_step()  # type: ignore[operator]

    out = timeline.record(serve, tmp_path / "timeline-x.json", skip=3, active=4)
    assert out["trace"] == "timeline-x.json.gz" and out["gz_bytes"] > 0
    assert out["window"] == [3 + timeline.WARMUP, 3 + timeline.WARMUP + 4]
    assert not (tmp_path / "timeline-x.json").exists()  # only the gzipped trace stays
    with gzip.open(tmp_path / "timeline-x.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = sorted(int(e["name"].split("#")[1]) for e in events
                   if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == list(range(*out["window"]))
    hooks = [e for e in events if e.get("name") == "mcv:wait_for_save"]
    assert len(hooks) == 4


def test_a_workload_shorter_than_the_window_still_writes_its_steps(tmp_path: Path) -> None:
    def serve(after_step: object) -> None:
        for _ in range(4):
            torch.ones(8).sum()
            after_step()  # type: ignore[operator]

    out = timeline.record(serve, tmp_path / "t.json", skip=1, active=50)
    assert out["trace"] == "t.json.gz" and out["gz_bytes"] > 0
