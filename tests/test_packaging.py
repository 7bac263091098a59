"""The BUILT wheel (not the tree) installs and works: a packaging mistake fails here.

``bash scripts/dev.sh test`` builds the wheel and sdist into build/dist first; run
alone, this test builds them itself (scripts/build_dist.py, offline, ~2 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "mooncake_vllm"

_CHECK = """
import importlib.metadata as md, json, sys
import mooncake_vllm, mooncake_vllm.config, mooncake_vllm.keys, mooncake_vllm.compat.registration
dist = md.distribution("mooncake-vllm")
print(json.dumps({
    "module": mooncake_vllm.__file__,
    "version": mooncake_vllm.__version__, "dist_version": dist.version,
    "entry_points": sorted(f"{e.group}:{e.name}={e.value}" for e in dist.entry_points),
    "requires": sorted(dist.requires or []),
}))
"""


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    built = ROOT / "build" / "dist"
    wheels, sdists = sorted(built.glob("mooncake_vllm-*.whl")), sorted(built.glob("mooncake_vllm-*.tar.gz"))
    newest_source = max(p.stat().st_mtime for p in [*SRC.rglob("*.py"), ROOT / "pyproject.toml"])
    if not (wheels and sdists) or wheels[-1].stat().st_mtime < newest_source:  # absent or stale
        sys.path.insert(0, str(ROOT / "scripts"))
        try:
            from build_dist import build
        finally:
            sys.path.pop(0)
        wheel, sdist = build(tmp_path_factory.mktemp("dist"))
        return wheel, sdist
    return wheels[-1], sdists[-1]


def test_built_wheel_installs_and_imports_with_its_entry_points(dist, tmp_path: Path) -> None:
    wheel, _ = dist
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "--no-index", "--target", str(target), str(wheel)], check=True)
    # -S: no site-packages processing, so the editable install of the tree cannot answer;
    # the venv's site-packages come AFTER the wheel, for the dependencies only.
    path = os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]])
    out = subprocess.run([sys.executable, "-S", "-c", _CHECK], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path).stdout
    info = json.loads(out)
    from mooncake_vllm import __version__

    assert Path(info["module"]).is_relative_to(target), info["module"]
    assert info["version"] == info["dist_version"] == __version__  # one version, read by pyproject
    assert info["entry_points"] == ["console_scripts:mooncake-vllm=mooncake_vllm.cli:main",
                                    "vllm.general_plugins:mooncake_vllm=mooncake_vllm.compat.registration:register"]
    assert any(r.startswith("packaging") for r in info["requires"])
    shipped = {p.relative_to(target / "mooncake_vllm").as_posix() for p in (target / "mooncake_vllm").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    tree = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert shipped == tree, f"missing from the wheel: {sorted(tree - shipped)}; extra: {sorted(shipped - tree)}"


def test_sdist_holds_the_sources_and_the_readme(dist) -> None:
    _, sdist = dist
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "src/mooncake_vllm/__init__.py"} <= names
    assert all(f"src/mooncake_vllm/{p.relative_to(SRC).as_posix()}" in names for p in SRC.rglob("*.py"))
