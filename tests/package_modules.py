"""The modules of the package, by name, and importing one: what the package-wide tests walk."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import pytest

import mooncake_vllm

#: what a module may fail to import for: an engine stack this environment lacks
ENGINE_STACK = ("vllm", "torch")


def module_names() -> list[str]:
    """Every module and package under ``mooncake_vllm`` (``__main__`` modules left out: importing one runs it)."""
    found = pkgutil.walk_packages(mooncake_vllm.__path__, prefix="mooncake_vllm.")
    return ["mooncake_vllm", *sorted(i.name for i in found if not i.name.endswith(".__main__"))]


def import_or_skip(name: str) -> ModuleType:
    """The module; a skip naming the package when it needs vLLM or torch and they are not
    installed. Any other import failure raises: a module that cannot be imported is broken."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in ENGINE_STACK:
            pytest.skip(f"{name} needs {exc.name}, not installed here")
        raise
