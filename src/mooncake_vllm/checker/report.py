"""Render a check result as text (grouped by severity), JSON (stable schema) or Markdown."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncake_vllm.checker.catalogue import ERROR, WARNING
from mooncake_vllm.checker.model import Finding

__all__ = ["EXIT_CLEAN", "EXIT_ERRORS", "EXIT_TOOL", "EXIT_WARNINGS", "SCHEMA", "CheckResult", "render"]

EXIT_CLEAN, EXIT_TOOL, EXIT_WARNINGS, EXIT_ERRORS = 0, 1, 2, 3
#: version of the JSON document; bumped only on incompatible changes
SCHEMA = "mooncake-vllm-check/1"
_TITLES = {ERROR: "Errors (block the deployment)", WARNING: "Warnings"}


@dataclass
class CheckResult:
    """The findings of one run plus what they were checked against."""

    findings: list[Finding]
    inputs: list[str] = field(default_factory=list)
    vllm: str | None = None
    vllm_origin: str = ""
    mooncake: str | None = None
    mooncake_origin: str = ""
    ignored: list[str] = field(default_factory=list)
    rules_run: int = 0
    probe: bool = False
    beyond_reference: list[str] = field(default_factory=list)  #: targets newer than the version tables

    def of(self, severity: str) -> list[Finding]:
        return [f for f in self.findings if f.severity == severity]

    @property
    def exit_code(self) -> int:
        if self.of(ERROR):
            return EXIT_ERRORS
        return EXIT_WARNINGS if self.of(WARNING) else EXIT_CLEAN

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "target": {"vllm": self.vllm, "vllm_origin": self.vllm_origin or None,
                       "mooncake": self.mooncake, "mooncake_origin": self.mooncake_origin or None},
            "beyond_reference": self.beyond_reference,
            "inputs": self.inputs,
            "probe": self.probe,
            "summary": {"errors": len(self.of(ERROR)), "warnings": len(self.of(WARNING)),
                        "rules_run": self.rules_run, "exit_code": self.exit_code},
            "ignored": self.ignored,
            "findings": [f.to_dict() for f in self.findings],
        }


def _groups(findings: Sequence[Finding]) -> list[tuple[Finding, list[str]]]:
    """Findings with the same rule, message and fix, merged with all their places."""
    merged: dict[tuple[str, str, str], tuple[Finding, list[str]]] = {}
    for f in findings:
        entry = merged.setdefault((f.id, f.message, f.fix), (f, []))
        if f.where:
            entry[1].append(str(f.where))
    return list(merged.values())


def _versions(result: CheckResult) -> str:
    parts = []
    if result.vllm:
        parts.append(f"vLLM {result.vllm} ({result.vllm_origin})")
    if result.mooncake:
        parts.append(f"Mooncake {result.mooncake} ({result.mooncake_origin})")
    text = ", ".join(parts) or "no vLLM or Mooncake installed or targeted (version rules skipped)"
    if result.beyond_reference:
        text += f"; newer than the version tables: {', '.join(result.beyond_reference)} (newest facts assumed)"
    return text


def _summary(result: CheckResult) -> str:
    errors, warnings = len(result.of(ERROR)), len(result.of(WARNING))
    if not errors and not warnings:
        return (f"All clear: {result.rules_run} rules found nothing to fix"
                f"{' (live probes included)' if result.probe else ''}.")
    verdict = "fix the errors before deploying" if errors else "warnings only: review them"
    return f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}: {verdict}."


def render_text(result: CheckResult) -> str:
    lines = [f"mooncake-vllm check: {len(result.inputs) or 'environment'}"
             f"{' input(s)' if result.inputs else ''}; {_versions(result)}"]
    for severity in (ERROR, WARNING):
        groups = _groups(result.of(severity))
        if not groups:
            continue
        lines += ["", f"{_TITLES[severity]}: {len(result.of(severity))}"]
        for f, places in groups:
            lines.append(f"  {f.id} {f.message}")
            if places:
                lines.append(f"      at:  {', '.join(places)}")
            lines.append(f"      why: {f.why or f.rule.why}")
            lines.append(f"      fix: {f.fix}")
            lines.append(f"      ref: {f.rule.reference}")
    if result.ignored:
        lines += ["", f"Ignored: {', '.join(result.ignored)}"]
    lines += ["", _summary(result)]
    return "\n".join(lines) + "\n"


def render_markdown(result: CheckResult) -> str:
    lines = ["# mooncake-vllm check", "", f"Checked against {_versions(result)}.", ""]
    for severity in (ERROR, WARNING):
        groups = _groups(result.of(severity))
        if not groups:
            continue
        lines += [f"## {_TITLES[severity]} ({len(result.of(severity))})", ""]
        for f, places in groups:
            lines.append(f"### `{f.id}` {f.message}")
            lines.append("")
            if places:
                lines.append(f"- **Where:** {', '.join(f'`{p}`' for p in places)}")
            lines.append(f"- **Why:** {f.why or f.rule.why}")
            lines.append(f"- **Fix:** {f.fix}")
            lines.append(f"- **Reference:** {f.rule.reference}")
            lines.append("")
    lines.append(f"**{_summary(result)}**")
    return "\n".join(lines) + "\n"


def render(result: CheckResult, fmt: str = "text") -> str:
    """``fmt``: ``text`` | ``json`` | ``markdown``."""
    if fmt == "json":
        return json.dumps(result.to_dict(), indent=2) + "\n"
    if fmt == "markdown":
        return render_markdown(result)
    return render_text(result)
