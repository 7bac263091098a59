"""pytest plugin: a JUnit file (``--junitxml``) records where its run came from.

Registered by ``tests/conftest.py``; active only when pytest writes JUnit. It adds

* suite properties, read from the env that ran (never typed in by hand): ``commit``
  and ``tree`` (clean/dirty) of the checkout, ``vllm`` / ``mooncake`` (``dist==version``),
  ``torch``, ``python``, ``device`` (``cpu`` or the CUDA device name) and
  ``device_count``, the selection (``paths``, ``markexpr``, ``keyword``,
  ``collected``, ``deselected``) and ``provenance_plugin``;
* per test case a ``markers`` property naming its level markers (:data:`LEVEL_MARKERS`),

so ``scripts/compat_table.py`` derives a run's level and per-marker counts from the
file alone (docs/compatibility.md).
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

#: The markers that define what a run covers (see LEVELS in scripts/compat_table.py).
LEVEL_MARKERS = ("vllm", "contract", "gpu", "v0")
PLUGIN_VERSION = "1"

try:  # pytest >= 7 keeps the JUnit writer in the config stash
    from _pytest.junitxml import xml_key as _XML_KEY
except ImportError:  # pragma: no cover - older pytest
    _XML_KEY = None


def _xml(config: pytest.Config):
    return config.stash.get(_XML_KEY, None) if _XML_KEY is not None else None


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _dist(pattern: str) -> str | None:
    from mooncake_vllm.compat import detect

    if pattern == "vllm":
        found = detect.installed_vllm()
        return f"{found.name}=={found.version}" if found else None
    dists = detect.installed_mooncake()
    return ",".join(f"{d.name}=={d.version}" for d in dists) or None


def _torch_and_device() -> tuple[str | None, str, int]:
    try:
        import torch
    except Exception:  # noqa: BLE001 - no torch in this env
        return None, "cpu", 0
    try:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return str(torch.__version__), str(torch.cuda.get_device_name(0)), n
    except Exception:  # noqa: BLE001 - a broken CUDA runtime counts as no GPU
        pass
    return str(torch.__version__), "cpu", 0


#: a copy of the tree without its history (the GPU machine gets files, not the repository):
#: the commit the copy was made from, and "clean" if it had no uncommitted change
TREE_COMMIT_ENV, TREE_STATE_ENV = "MOONCAKE_VLLM_TREE_COMMIT", "MOONCAKE_VLLM_TREE_STATE"


def checkout(config: pytest.Config) -> dict[str, str]:
    """Commit and clean/dirty state of the checkout, read as the session starts."""
    if os.environ.get(TREE_COMMIT_ENV):
        return {"commit": os.environ[TREE_COMMIT_ENV],
                "tree": os.environ.get(TREE_STATE_ENV, "unknown")}
    root = Path(str(config.rootpath))
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain")
    return {"commit": commit or "unknown",
            "tree": "unknown" if status is None else ("dirty" if status else "clean")}


def provenance(config: pytest.Config, selected: int, deselected: int,
               tree: dict[str, str] | None = None) -> dict[str, str]:
    """The suite properties of this run (strings; no machine-specific paths)."""
    root = Path(str(config.rootpath))
    torch_version, device, count = _torch_and_device()
    paths = []
    for arg in config.args:
        p = Path(arg.split("::", 1)[0])
        try:
            rel = str(p.resolve().relative_to(root.resolve()))
        except (OSError, ValueError):
            rel = p.name  # outside the checkout: keep the name only
        paths.append(rel + (("::" + arg.split("::", 1)[1]) if "::" in arg else ""))
    props = {
        "provenance_plugin": PLUGIN_VERSION,
        **(tree or checkout(config)),
        "vllm": _dist("vllm") or "none",
        "mooncake": _dist("mooncake") or "none",
        "torch": torch_version or "none",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "device": device,
        "device_count": str(count),
        "paths": " ".join(paths),
        "markexpr": config.getoption("markexpr", "") or "",
        "keyword": config.getoption("keyword", "") or "",
        "collected": str(selected + deselected),
        "deselected": str(deselected),
        "contract_env": os.environ.get("MOONCAKE_VLLM_CONTRACT_ENV", ""),
    }
    return props


class ProvenancePlugin:
    def __init__(self, config: pytest.Config) -> None:
        self.deselected = 0
        self.tree = checkout(config) if getattr(config.option, "xmlpath", None) else None

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += len(items)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        xml = _xml(session.config)
        if xml is None:
            return
        for name, value in provenance(session.config, len(session.items), self.deselected,
                                       self.tree).items():
            xml.add_global_property(name, value)
        for item in session.items:
            marks = sorted({m.name for m in item.iter_markers()} & set(LEVEL_MARKERS))
            if marks:
                item.user_properties.append(("markers", ",".join(marks)))


def register(config: pytest.Config) -> None:
    """Register once per session (called from tests/conftest.py's pytest_configure)."""
    if not config.pluginmanager.has_plugin("mooncake-vllm-provenance"):
        config.pluginmanager.register(ProvenancePlugin(config), "mooncake-vllm-provenance")


__all__ = ["LEVEL_MARKERS", "ProvenancePlugin", "checkout", "provenance", "register"]
