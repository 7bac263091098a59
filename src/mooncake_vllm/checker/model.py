"""What the checker reads (a deployment) and what it reports (findings)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from mooncake_vllm.checker.catalogue import Rule
from mooncake_vllm.config import CONFIG_ENV

__all__ = ["Deployment", "Finding", "Launch", "MooncakeConfigFile", "Where", "pip_pins"]


@dataclass(frozen=True)
class Where:
    """A place in the inputs: ``path:line`` (line 0 = the whole file / environment)."""

    path: str
    line: int = 0

    def __str__(self) -> str:
        return f"{self.path}:{self.line}" if self.line else self.path


@dataclass(frozen=True)
class Finding:
    """One rule hit: the rule, the filled-in message and fix, and where it was found."""

    rule: Rule
    message: str
    fix: str
    where: Where | None = None
    why: str = ""  #: filled-in why (empty = the rule's)

    @property
    def id(self) -> str:
        return self.rule.id

    @property
    def severity(self) -> str:
        return self.rule.severity

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON schema: id, severity, message, why, fix, where, reference."""
        return {"id": self.rule.id, "severity": self.rule.severity, "name": self.rule.name,
                "message": self.message, "why": self.why or self.rule.why, "fix": self.fix,
                "where": str(self.where) if self.where else None, "reference": self.rule.reference}


#: launch kinds
VLLM, PROXY, MASTER, HOLDER, METADATA, PIP, OTHER = "vllm", "proxy", "master", "holder", "metadata", "pip", "other"


@dataclass
class Launch:
    """One command found in a script (or the current environment, ``kind="environment"``)."""

    kind: str
    argv: list[str]
    env: dict[str, str]  #: exported variables + ``VAR=... cmd`` prefixes
    where: Where
    prefix_env: dict[str, str] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)  #: ``--long-option`` -> value ("" for a flag)
    model: str | None = None
    program: str = ""  #: e.g. "vllm serve", "disagg_proxy_demo.py", "mooncake_master"
    kv_config: dict[str, Any] | None = None
    kv_config_error: str | None = None
    kv_config_raw: str | None = None

    @property
    def is_vllm(self) -> bool:
        return self.kind in (VLLM, "environment")

    def option(self, *names: str) -> str | None:
        for name in names:
            if name in self.options:
                return self.options[name]
        return None

    def int_option(self, *names: str, default: int = 1) -> int:
        value = self.option(*names)
        try:
            return int(value) if value not in (None, "") else default
        except ValueError:
            return default

    def connectors(self) -> list[dict[str, Any]]:
        """The kv-transfer-config and, for MultiConnector, its children."""
        if not isinstance(self.kv_config, dict):
            return []
        found = [self.kv_config]
        extra = self.kv_config.get("kv_connector_extra_config")
        if isinstance(extra, dict) and isinstance(extra.get("connectors"), list):
            found += [c for c in extra["connectors"] if isinstance(c, dict)]
        return found

    def connector_names(self) -> list[str]:
        return [str(c.get("kv_connector")) for c in self.connectors() if c.get("kv_connector")]

    def uses_store(self) -> bool:
        return "MooncakeStoreConnector" in self.connector_names()

    def uses_mooncake_vllm(self) -> bool:
        """True when every MooncakeStoreConnector entry names mooncake-vllm's module path."""
        stores = [c for c in self.connectors() if c.get("kv_connector") == "MooncakeStoreConnector"]
        top = self.kv_config or {}
        return bool(stores) and all(
            str(c.get("kv_connector_module_path") or top.get("kv_connector_module_path") or "").startswith(
                "mooncake_vllm") for c in stores)

    def roles(self) -> set[str]:
        return {str(c.get("kv_role")) for c in self.connectors()[:1] if c.get("kv_role")}


@dataclass
class MooncakeConfigFile:
    """A Mooncake JSON config (V0 ``mooncake.json`` or V1 ``mooncake_config.json``)."""

    path: str
    data: dict[str, Any]
    lines: dict[str, int]  #: key -> line number

    def where(self, key: str | None = None) -> Where:
        return Where(self.path, self.lines.get(key, 0) if key else 0)

    @property
    def shape(self) -> str:
        """``"v0-pipe"``, ``"v0"`` or ``"v1"``."""
        if "prefill_url" in self.data or "decode_url" in self.data:
            return "v0-pipe"
        sizes = [self.data.get(k) for k in ("global_segment_size", "local_buffer_size") if k in self.data]
        if "local_hostname" in self.data and all(isinstance(s, int) for s in sizes):
            return "v0"
        return "v1"

    def text(self) -> str:
        return json.dumps(self.data, indent=2)


@dataclass
class Deployment:
    """Everything read from the PATHs (or the environment)."""

    launches: list[Launch] = field(default_factory=list)
    configs: list[MooncakeConfigFile] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    from_environment: bool = False

    def of_kind(self, *kinds: str) -> list[Launch]:
        return [launch for launch in self.launches if launch.kind in kinds]

    @property
    def instances(self) -> list[Launch]:
        """vLLM launches (or the environment pseudo-instance)."""
        return [launch for launch in self.launches if launch.is_vllm]

    def configs_for(self, launch: Launch) -> list[MooncakeConfigFile]:
        """The config an instance uses (matched by MOONCAKE_CONFIG_PATH's file name), else all configs."""
        path = launch.env.get(CONFIG_ENV)
        if path:
            name = path.replace("\\", "/").rsplit("/", 1)[-1]
            matched = [c for c in self.configs if c.path.replace("\\", "/").rsplit("/", 1)[-1] == name]
            if matched:
                return matched
        return list(self.configs)


_MOONCAKE_REQ = re.compile(r"^(mooncake[-_.]transfer[-_.]engine(?:[-_.][a-z0-9]+)*)(?:\[[^\]]*\])?(?:==([^,;\s]+))?",
                           re.IGNORECASE)


def pip_pins(deployment: Deployment) -> list[tuple[str, str | None, Where]]:
    """``(package, pinned version or None, where)`` for each Mooncake ``pip install`` in the scripts."""
    pins = []
    for launch in deployment.of_kind(PIP):
        if "install" not in launch.argv:
            continue
        for arg in launch.argv[launch.argv.index("install") + 1:]:
            m = _MOONCAKE_REQ.match(arg)
            if m:
                pins.append((m[1].lower().replace("_", "-"), m[2], launch.where))
    return pins
