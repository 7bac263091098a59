"""Import a file of bench/ or scripts/ (they are not packages) under its stem, as its
neighbours import it by name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["ROOT", "load_script"]

ROOT = Path(__file__).resolve().parents[2]


def load_script(path: str) -> ModuleType:
    """The module of ``path`` (relative to the repository root), registered in ``sys.modules``;
    its folder goes on ``sys.path``, where the script's own imports of its neighbours look."""
    file = ROOT / path
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module
    spec.loader.exec_module(module)
    return module
