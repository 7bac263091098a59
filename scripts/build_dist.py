"""Build the wheel and the sdist into a folder, offline, with the current interpreter.

    python scripts/build_dist.py build/dist

Like ``python -m build --no-isolation`` without needing the ``build`` package: the
PEP 517 hooks of setuptools (the declared backend) run in a child process per
artifact so their build/ and egg-info scratch never mix. Prints the files built.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(out: Path) -> list[Path]:
    """The built ``[wheel, sdist]`` paths under ``out``."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    built = []
    for hook in ("build_wheel", "build_sdist"):
        code = (f"import setuptools.build_meta as b, sys; "
                f"print(b.{hook}({str(out)!r}))")
        name = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, text=True,
                              capture_output=True).stdout.strip().splitlines()[-1]
        built.append(out / name)
    return built


if __name__ == "__main__":
    for path in build(Path(sys.argv[1] if len(sys.argv) > 1 else "build/dist")):
        print(path)
