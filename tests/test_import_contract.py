"""The layering of docs/DESIGN.md ("Layers"), enforced on the source with ``ast``.

Every ``import`` counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = "mooncake_vllm"
SRC = Path(__file__).resolve().parents[1] / "src" / PKG

#: the runtime vLLM loads: it must work without any tooling package
RUNTIME = {"v0", "v1", "store", "keys", "config", "codec", "layout", "errors", "stats",
           "addresses", "compat", "settings", "logs", "files", "handoff_protocol", "placement"}
#: tooling: command lines, services, checker, proxy, demo, metadata tools
TOOLING = {"checker", "proxy", "services", "demo", "cli", "metadata", "httpsafe", "inventory"}
#: no exceptions: the redis bridge the store starts lives in the runtime (store/bridge.py)
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(dotted: str) -> str | None:
    """``mooncake_vllm.a.b`` -> the module key ``a.b`` (or its nearest existing parent)."""
    if dotted != PKG and not dotted.startswith(PKG + "."):
        return None
    name = dotted[len(PKG) + 1:]
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(path: Path) -> set[str]:
    """Module keys (``""`` = the package root) that ``path`` imports at run time."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(t for a in child.names if (t := _resolve(a.name)) is not None)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for alias in child.names:  # `from pkg import submodule` imports the submodule
                    target = _resolve(f"{child.module}.{alias.name}")
                    if target is not None:
                        found.add(target)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def _top(name: str) -> str:
    return name.split(".")[0]


def test_runtime_imports_no_tooling() -> None:
    bad = sorted((src, dst) for src, targets in GRAPH.items() if _top(src) in RUNTIME
                 for dst in targets if _top(dst) in TOOLING and (_top(src), dst) not in ALLOWED)
    assert bad == [], f"runtime modules import tooling: {bad}"
    assert all(_top(m) in RUNTIME | TOOLING for m in MODULES if m), "a new top-level module: add it to a layer"


def test_v0_and_v1_never_import_each_other() -> None:
    for a, b in (("v0", "v1"), ("v1", "v0")):
        bad = sorted((src, dst) for src, targets in GRAPH.items() if _top(src) == a
                     for dst in targets if _top(dst) == b)
        assert bad == [], bad


def test_no_import_cycles() -> None:
    """No module reaches itself (a package's __init__ re-exporting its submodules is not a cycle)."""
    edges = {src: {d for d in targets if not (d and src.startswith(d + "."))} - {""}
             for src, targets in GRAPH.items()}
    cycles = []
    for start in edges:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == [], "\n".join(sorted(set(cycles)))


def test_the_contract_sees_imports() -> None:
    """Guard against a contract that passes because it parses nothing."""
    assert "config" in GRAPH["v1.connector"] and "store" in GRAPH["v0.connector"]
    assert "store.bridge" in GRAPH["store.connect"] and "store.bridge" in GRAPH["metadata.server"]
