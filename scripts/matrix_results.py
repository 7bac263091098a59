#!/usr/bin/env python3
"""Summarise the tox matrix: per env, the JUnit results and the env builder's record.

Reads ``build/test-results/<tox env>.xml`` (written by every tox env) and
``<cache>/envs/<dist>-<version>/mooncake-vllm-env.json`` (written by
``scripts/make_vllm_env.py``) and prints one JSON object per env: the input of
the generated compatibility table (issue 7). Stdlib only.

    python scripts/matrix_results.py [--results build/test-results]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["env_record", "junit_counts", "main"]

REPO = Path(__file__).resolve().parent.parent
_SUITE_RE = re.compile(r"^(?P<dist>vllm(?:-cpu)?)-(?P<version>\d+\.\d+\.\d+)$")


def junit_counts(path: Path) -> dict[str, object]:
    """tests / failures / errors / skipped / seconds / timestamp of one JUnit file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {"error": f"no testsuite in {path}"}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {"tests": int(suite.get("tests", 0)), "failures": int(suite.get("failures", 0)),
            "errors": int(suite.get("errors", 0)), "skipped": int(suite.get("skipped", 0)),
            "seconds": float(suite.get("time", 0.0)), "timestamp": suite.get("timestamp"),
            "suite": suite.get("name"), "failed": failed}


def env_record(suite: str | None) -> dict[str, object] | None:
    """The env builder's record for a JUnit suite named ``<dist>-<version>`` (set by tox.ini)."""
    m = _SUITE_RE.match(suite or "")
    if not m:
        return None
    cache = Path(os.environ.get("MOONCAKE_VLLM_CACHE", Path.home() / ".cache" / "mooncake-vllm"))
    stamp = cache / "envs" / f"{m['dist']}-{m['version']}" / "mooncake-vllm-env.json"
    if stamp.exists():
        return json.loads(stamp.read_text())
    return {"dist": m["dist"], "vllm": m["version"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=REPO / "build" / "test-results")
    args = p.parse_args(argv)
    files = sorted(args.results.glob("*.xml"))
    if not files:
        print(f"no results in {args.results}; run tox first", file=sys.stderr)
        return 1
    for path in files:
        results = junit_counts(path)
        print(json.dumps({"env": path.stem, "results": results,
                          "build": env_record(results.get("suite"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
