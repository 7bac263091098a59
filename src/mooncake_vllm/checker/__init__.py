"""``mooncake-vllm check``: judge a Mooncake + vLLM deployment against a vLLM / Mooncake release.

* :mod:`.catalogue`: every rule (stable ID, message, why, fix, reference);
* :mod:`.parse`: launch scripts, JSON configs, env files, directories;
* :mod:`.rules_engine`, :mod:`.rules_mooncake`, :mod:`.rules_fleet`: offline rules;
* :mod:`.probe`: ``--probe`` live checks; :mod:`.report`: text / json / markdown;
* :mod:`.fix`: ``--fix OUTDIR`` writes the migrated V1 config and launch script.

Versions come from package metadata and :mod:`mooncake_vllm.compat.versions`;
nothing here imports vLLM or Mooncake.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from mooncake_vllm.checker import rules_engine as _rules_engine  # noqa: F401 - registers rules
from mooncake_vllm.checker import rules_fleet as _rules_fleet  # noqa: F401 - registers rules
from mooncake_vllm.checker import rules_mooncake as _rules_mooncake  # noqa: F401 - registers rules
from mooncake_vllm.checker.catalogue import RULES, Rule
from mooncake_vllm.checker.context import CHECKS, Context
from mooncake_vllm.checker.model import Deployment, Finding
from mooncake_vllm.checker.parse import read_deployment
from mooncake_vllm.checker.report import CheckResult, render
from mooncake_vllm.compat.detect import installed_mooncake, installed_vllm
from mooncake_vllm.compat.versions import mooncake_facts, vllm_facts
from mooncake_vllm.errors import ConfigError, ConfigProblem

__all__ = ["CheckResult", "Finding", "Rule", "RULES", "build_context", "render", "resolve_ignores", "run_check",
           "run_rules"]



def build_context(
    deployment: Deployment, *, target_vllm: str | None = None, target_mooncake: str | None = None,
    probe: bool = False, timeout: float = 1.0, site_path: Iterable[str] | None = None,
) -> Context:
    """Attach the target (or installed) vLLM / Mooncake facts to ``deployment``."""
    ctx = Context(deployment, probe=probe, timeout=timeout)
    site = list(site_path) if site_path is not None else None
    ctx.installed_mooncake = installed_mooncake(site)
    if target_vllm:
        ctx.vllm, ctx.vllm_origin = vllm_facts(target_vllm), "--target-vllm"
    elif (dist := installed_vllm(site)) is not None:
        ctx.vllm, ctx.vllm_origin = vllm_facts(dist.version), f"installed {dist.name}"
    if target_mooncake:
        ctx.mooncake, ctx.mooncake_origin = mooncake_facts(target_mooncake), "--target-mooncake"
        ctx.mooncake_explicit = True
    elif ctx.installed_mooncake:
        dist = ctx.installed_mooncake[0]
        ctx.mooncake, ctx.mooncake_origin = mooncake_facts(dist.version), f"installed {dist.name}"
    return ctx


def resolve_ignores(ignore: Iterable[str]) -> set[str]:
    """Rule IDs (or names) to silence; an unknown one is a :class:`ConfigError`."""
    by_name = {r.name: r.id for r in RULES.values()}
    ids, bad = set(), []
    for item in ignore:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            rule_id = part.upper() if part.upper() in RULES else by_name.get(part)
            if rule_id is None:
                bad.append(part)
            else:
                ids.add(rule_id)
    if bad:
        raise ConfigError("--ignore", [ConfigProblem("--ignore", f"unknown rule {b!r}",
                                                     "use an ID such as MCV-W003 (see --list-rules)") for b in bad])
    return ids


def run_rules(ctx: Context, ignore: Iterable[str] = ()) -> list[Finding]:
    """Every registered rule not in ``ignore``; findings de-duplicated, in rule order."""
    if ctx.probe:  # the live probes register on import: cheap offline rules first, probes last
        from mooncake_vllm.checker import probe  # noqa: F401
    skip = set(ignore)
    findings: list[Finding] = []
    seen: set[tuple[str, str, str]] = set()
    for rule, fn in CHECKS:
        if rule.id in skip or (rule.probe and not ctx.probe):
            continue
        for finding in fn(ctx, rule):
            key = (finding.id, finding.message, str(finding.where))
            if key not in seen:
                seen.add(key)
                findings.append(finding)
    return findings


def run_check(
    paths: Iterable[str | os.PathLike[str]] = (), *, target_vllm: str | None = None,
    target_mooncake: str | None = None, probe: bool = False, ignore: Iterable[str] = (),
    env: Mapping[str, str] | None = None, timeout: float = 1.0,
) -> tuple[CheckResult, Context]:
    """Read ``paths`` (or the environment), run the rules, return the result and its context.

    Raises :class:`ConfigError` / :class:`UnsupportedVersionError` for bad input.
    """
    ignored = resolve_ignores(ignore)
    deployment = read_deployment(paths, env=env)
    ctx = build_context(deployment, target_vllm=target_vllm, target_mooncake=target_mooncake, probe=probe,
                        timeout=timeout)
    findings = run_rules(ctx, ignored)
    rules_run = sum(1 for r in RULES.values() if r.id not in ignored and (probe or not r.probe))
    result = CheckResult(findings, inputs=list(deployment.sources), ignored=sorted(ignored),
                         vllm=ctx.vllm.version if ctx.vllm else None, vllm_origin=ctx.vllm_origin,
                         mooncake=ctx.mooncake.version if ctx.mooncake else None,
                         mooncake_origin=ctx.mooncake_origin, rules_run=rules_run, probe=probe,
                         beyond_reference=[f"{name} {facts.version}" for name, facts in
                                           (("vLLM", ctx.vllm), ("Mooncake", ctx.mooncake))
                                           if facts is not None and not facts.known])
    return result, ctx
