"""docs/DESIGN.md stays true: its package map names every runtime module, and each
signature quoted under "Core signatures" has the real function's parameters."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

import mooncake_vllm
from mooncake_vllm import store

_PKG = Path(mooncake_vllm.__file__).parent
DESIGN = (_PKG.parents[1] / "docs" / "DESIGN.md").read_text()
_CORE = DESIGN.split("## Core signatures", 1)[1].split("```python", 1)[1].split("```", 1)[0]


def _modules(pkg: str) -> list[str]:
    return sorted(p.stem for p in (_PKG / pkg).glob("*.py") if p.stem != "__init__")


def _map_row(name: str) -> str:
    (row,) = [line for line in DESIGN.splitlines() if line.startswith(f"| `{name}/` |")]
    return row


@pytest.mark.parametrize("pkg, module", [(p, m) for p in ("store", "v1") for m in _modules(p)])
def test_every_store_and_v1_module_is_in_the_package_map(pkg: str, module: str) -> None:
    row = _map_row(pkg)
    assert re.search(rf"`{module}(\.py)?`", row), f"docs/DESIGN.md's {pkg}/ row lacks {module}"


@pytest.mark.parametrize("module", _modules("store"))
def test_every_store_module_is_in_the_store_package_table(module: str) -> None:
    assert f"``{module}``" in (store.__doc__ or ""), f"store/__init__.py's table lacks {module}"
    assert re.search(rf"\b{module}\b", DESIGN.split("## Package map")[0]), \
        f"the layer diagram's store/ list lacks {module}"


def _quoted() -> list[tuple[str, str, str | None, str]]:
    """(module, qualified name, class, params text) of every ``def`` quoted in the block."""
    out, module, cls = [], "", None
    lines: list[str] = []
    for line in _CORE.splitlines():  # a def continued over several lines is one
        if lines and lines[-1].lstrip().startswith("def ") and \
                lines[-1].count("(") > lines[-1].count(")"):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    for line in lines:
        if m := re.match(r"# ([\w/]+)\.py$", line):
            module, cls = "mooncake_vllm." + m.group(1).replace("/", "."), None
        elif m := re.match(r"class (\w+)", line):
            cls = m.group(1)
        elif m := re.match(r"(\s*)def (\w+)\((.*?)\)\s*(->|$)", line):
            if not m.group(1):
                cls = None
            out.append((module, f"{cls + '.' if cls else ''}{m.group(2)}", cls, m.group(3)))
    return out


def _names(params: str) -> list[str]:
    """Parameter names (and ``*``) of a quoted parameter list; nested brackets skipped."""
    depth, parts, cur = 0, [], ""
    for ch in params:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    names = [re.split(r"[:=]", p.strip(), maxsplit=1)[0].strip() for p in parts if p.strip()]
    return [n for n in names if n not in ("self", "cls")]


def test_the_core_signatures_block_is_parsed() -> None:
    assert len(_quoted()) >= 15


@pytest.mark.parametrize("module, name, cls, params", _quoted(), ids=lambda v: str(v)[:40])
def test_each_quoted_signature_matches_the_code(module: str, name: str, cls: str | None,
                                                params: str) -> None:
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    real = []
    for p in inspect.signature(obj).parameters.values():
        if p.name in ("self", "cls"):
            continue
        if p.kind is p.KEYWORD_ONLY and "*" not in real:
            real.append("*")
        real.append(p.name)
    assert _names(params) == real, f"docs/DESIGN.md quotes {name}({params}); the code has {real}"


@pytest.mark.parametrize("module, cls", [("mooncake_vllm.config", "StoreConfig"),
                                         ("mooncake_vllm.keys", "KeyNamespace"),
                                         ("mooncake_vllm.keys", "RequestExtras")])
def test_each_quoted_dataclass_lists_its_fields(module: str, cls: str) -> None:
    block = _CORE.split(f"class {cls}:", 1)[1].split("\nclass ", 1)[0].split("\ndef ", 1)[0]
    body = "\n".join(ln for ln in block.splitlines() if "def " not in ln and "@" not in ln)
    quoted = re.findall(r"(?:^|;)\s*(\w+): ", re.sub(r"#.*", "", body), flags=re.M)
    fields = [f.name for f in dataclasses.fields(getattr(importlib.import_module(module), cls))]
    assert quoted == fields
