"""The matrix summary reads JUnit files and the env builder's records."""

from __future__ import annotations

import json
from pathlib import Path

from tests.scripts._load import load_script

ROOT = Path(__file__).resolve().parents[2]
mr = load_script("scripts/matrix_results.py")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="vllm-0.10.0" errors="0"
failures="1" skipped="2" tests="5" time="12.5" timestamp="2026-11-29T22:00:00"><testcase classname="a" name="ok"/>
<testcase classname="tests.contract.test_contract" name="test_x"><failure message="boom"/></testcase>
</testsuite></testsuites>"""


def test_summary_per_env(tmp_path: Path, monkeypatch, capsys) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "contract-vllm0100.xml").write_text(JUNIT)
    env = tmp_path / "cache" / "envs" / "vllm-0.10.0"
    env.mkdir(parents=True)
    (env / "mooncake-vllm-env.json").write_text(json.dumps({"vllm": "0.10.0", "build_seconds": 17.5}))
    monkeypatch.setenv("MOONCAKE_VLLM_CACHE", str(tmp_path / "cache"))
    assert mr.main(["--results", str(results)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    row = json.loads(line)
    assert row["env"] == "contract-vllm0100" and row["build"]["build_seconds"] == 17.5
    assert row["results"]["failures"] == 1 and row["results"]["skipped"] == 2
    assert row["results"]["failed"] == ["tests.contract.test_contract::test_x"]


def test_no_results_is_an_error(tmp_path: Path) -> None:
    assert mr.main(["--results", str(tmp_path)]) == 1
