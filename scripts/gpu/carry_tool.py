#!/usr/bin/env python3
"""Helpers for carrying vLLM + Mooncake to the GPU machine (stdlib only; runs here and there).

  carry_tool.py extract ARCHIVE=DEST ...     unpack .tar.xz archives in parallel, one process each
  carry_tool.py unpack-stream DEST SHA256 DONE PART ... [--install-wheels SITE]
                                             unpack the tar (.xz or plain) split into PARTs (in
                                             order) into DEST while hashing the stream; then
                                             install every DEST/*.whl into SITE; DONE is written
                                             only if all of it worked and the sha256 matches
  carry_tool.py install-wheels SITE WHEEL ...  install wheels into SITE in parallel, as
                                             `pip install --no-deps --target` lays them out
  carry_tool.py fatbin-list SO               entries of an ELF's .nv_fatbin (kind, arch, bytes)
  carry_tool.py fatbin-prune SRC DST [ARCH [PATCH]]
                                             copy SRC to DST, dropping the fatbin ELF images that an
                                             sm_ARCH GPU can never load (default 90: H100/H200);
                                             PATCH: also write the dropped bytes, for fatbin-unprune
  carry_tool.py fatbin-unprune DST PATCH OUT rebuild SRC byte for byte (sha256-checked)
  carry_tool.py sonames DIR ...              'SONAME PATH' for each shared library in DIRs
  carry_tool.py fatbin-check SO              on the GPU machine: load every fatbin of SO that holds
                                             an image for this GPU with cuModuleLoadFatBinary

Why prune: vLLM's _C_stable_libtorch.abi3.so carries its kernels as zstd-compressed cubins for
sm_75/80/86/89/90/100/120, which no archiver can shrink (85 MB as .xz). A cubin for sm_8x, sm_10x or
sm_12x never runs on sm_90 (cubins are only compatible within one major version), so on an H200 only
the sm_90/sm_90a cubins and the PTX are ever read. fatbin-prune rewrites each fatbin in place: the
header plus the kept entries, then zeros up to the fatbin's old end, so every offset in the ELF (and
every pointer the CUDA runtime registers) stays where it was; a fatbin that would keep nothing is left
untouched. The kept entries are byte-identical (checked with cuobjdump here, see make_bundles.sh).
"""
from __future__ import annotations

import concurrent.futures as cf
import ctypes
import hashlib
import io
import json
import os
import struct
import sys
import tarfile
import time
import zipfile

FATBIN_MAGIC = 0xBA55ED50
KIND = {1: "ptx", 2: "elf"}


# ---------------------------------------------------------------- fatbin
def _sections(data: bytes) -> dict[str, tuple[int, int]]:
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = []
    for i in range(shnum):
        name, _typ, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        raw.append((name, off, size))
    stroff = raw[shstrndx][1]
    out = {}
    for name, off, size in raw:
        end = data.index(b"\0", stroff + name)
        out[data[stroff + name:end].decode()] = (off, size)
    return out


def fatbins(data: bytes):
    """Yield (blob_offset, blob_size, [entry dicts]) for each fatbin in .nv_fatbin."""
    secs = _sections(data)
    if ".nv_fatbin" not in secs:
        return
    off, size = secs[".nv_fatbin"]
    p, end = off, off + size
    while p + 16 <= end:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8  # blobs are 8-byte aligned; skip padding
            continue
        entries = []
        q, qe = p + hsz, p + hsz + fsz
        while q < qe:
            kind, _v, ehsz, psz = struct.unpack_from("<HHIQ", data, q)
            arch, = struct.unpack_from("<I", data, q + 28)
            entries.append(dict(kind=kind, arch=arch, off=q, size=ehsz + psz))
            q += ehsz + psz
        if q != qe:
            raise ValueError(f"fatbin at {p:#x}: entries overrun its size")
        yield p, hsz, hsz + fsz, entries
        p = qe


def _usable(e: dict, arch: int) -> bool:
    """Can a GPU of compute capability `arch` (e.g. 90) ever load this entry?"""
    if KIND.get(e["kind"]) == "ptx":
        return e["arch"] <= arch
    return e["arch"] // 10 == arch // 10 and e["arch"] <= arch


def fatbin_list(path: str) -> None:
    data = open(path, "rb").read()
    tally: dict[tuple, list[int]] = {}
    n = 0
    for _p, _h, _s, entries in fatbins(data):
        n += 1
        for e in entries:
            t = tally.setdefault((KIND.get(e["kind"], e["kind"]), e["arch"]), [0, 0])
            t[0] += 1
            t[1] += e["size"]
    print(f"{path}: {n} fatbins")
    for (kind, arch), (cnt, size) in sorted(tally.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind} sm_{arch}: {cnt} entries, {size / 1e6:.2f} MB")


def fatbin_prune(src: str, dst: str, arch: int = 90, patch: str | None = None) -> None:
    """Write DST = SRC without the fatbin images an sm_`arch` GPU cannot load; with `patch`, also
    write what fatbin-unprune needs to rebuild SRC byte for byte from DST."""
    orig = open(src, "rb").read()
    data = bytearray(orig)
    kept_blobs = untouched = dropped = 0
    dropped_bytes = 0
    layout, chunks, chunk_off = [], [], 0
    for p, hsz, total, entries in list(fatbins(orig)):
        keep = [e for e in entries if _usable(e, arch)]
        if not keep or len(keep) == len(entries):
            untouched += 1
            continue
        body = b"".join(orig[e["off"]:e["off"] + e["size"]] for e in keep)
        header = bytearray(orig[p:p + hsz])
        struct.pack_into("<Q", header, 8, len(body))
        new = bytes(header) + body
        data[p:p + total] = new + b"\0" * (total - len(new))
        rec = {"p": p, "total": total, "header": orig[p:p + hsz].hex(), "entries": []}
        q = p + hsz
        for e in entries:
            if e in keep:
                rec["entries"].append(["keep", q, e["size"]])
                q += e["size"]
            else:
                rec["entries"].append(["drop", chunk_off, e["size"]])
                chunks.append(orig[e["off"]:e["off"] + e["size"]])
                chunk_off += e["size"]
        layout.append(rec)
        kept_blobs += 1
        dropped += len(entries) - len(keep)
        dropped_bytes += total - len(new)
    tmp = dst + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, os.stat(src).st_mode & 0o777)
    os.replace(tmp, dst)
    if patch:
        head = json.dumps({"sha256": hashlib.sha256(orig).hexdigest(), "size": len(orig),
                           "pruned_sha256": hashlib.sha256(data).hexdigest(), "blobs": layout}).encode()
        with open(patch, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for c in chunks:
                f.write(c)
        unprune(dst, patch, dst + ".check")  # proves the patch rebuilds SRC exactly
        os.remove(dst + ".check")
    print(f"pruned {src} -> {dst}: {kept_blobs} fatbins rewritten, {untouched} untouched, "
          f"{dropped} entries ({dropped_bytes / 1e6:.1f} MB) zeroed; sm_{arch} images and PTX kept"
          + (f"; patch {patch} ({os.path.getsize(patch) / 1e6:.1f} MB) rebuilds the original" if patch else ""))


def unprune(pruned: str, patch: str, dst: str) -> None:
    """Rebuild the original file from a pruned one and its patch; the sha256 must match."""
    src = open(pruned, "rb").read()
    with open(patch, "rb") as f:
        n, = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
        extra = f.read()
    if hashlib.sha256(src).hexdigest() != head["pruned_sha256"]:
        raise SystemExit(f"{pruned} is not the file this patch was made against")
    data = bytearray(src)
    for rec in head["blobs"]:
        parts = [bytes.fromhex(rec["header"])]
        for how, off, size in rec["entries"]:
            parts.append(src[off:off + size] if how == "keep" else extra[off:off + size])
        blob = b"".join(parts)
        if len(blob) != rec["total"]:
            raise SystemExit(f"patch: blob at {rec['p']:#x} rebuilt to {len(blob)} bytes, not {rec['total']}")
        data[rec["p"]:rec["p"] + rec["total"]] = blob
    if len(data) != head["size"] or hashlib.sha256(data).hexdigest() != head["sha256"]:
        raise SystemExit("unprune: rebuilt file does not match the original's sha256")
    tmp = dst + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dst)


def fatbin_check(path: str) -> int:
    """Load, with the CUDA driver, every fatbin of `path` that has an image for this GPU."""
    cuda = ctypes.CDLL("libcuda.so.1")
    def ck(rc, what):
        if rc != 0:
            msg = ctypes.c_char_p()
            cuda.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what}: CUDA error {rc} {msg.value.decode() if msg.value else ''}")
    ck(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    major, minor = ctypes.c_int(), ctypes.c_int()
    ck(cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev), "cc major")
    ck(cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev), "cc minor")
    arch = major.value * 10 + minor.value
    ctx = ctypes.c_void_p()
    ck(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    data = open(path, "rb").read()
    buf = ctypes.create_string_buffer(data, len(data))
    base = ctypes.addressof(buf)
    ok = skipped = ptx_only = 0
    t = time.time()
    for p, _h, _s, entries in fatbins(data):
        usable = [e for e in entries if _usable(e, arch)]
        if not usable:
            skipped += 1
            continue
        if not any(KIND.get(e["kind"]) == "elf" for e in usable):
            ptx_only += 1  # the driver would JIT-compile the PTX (slow); vLLM does that only on use
            continue
        mod = ctypes.c_void_p()
        ck(cuda.cuModuleLoadFatBinary(ctypes.byref(mod), ctypes.c_void_p(base + p)), f"fatbin at {p:#x}")
        ck(cuda.cuModuleUnload(mod), "cuModuleUnload")
        ok += 1
    print(f"fatbin-check {os.path.basename(path)} on sm_{arch}: {ok} fatbins with sm_{arch} cubins loaded OK, "
          f"{ptx_only} PTX-only (not JIT-compiled here), {skipped} without an image for this GPU; "
          f"{time.time() - t:.1f}s")
    return 0


def soname(path: str) -> str | None:
    """DT_SONAME of a 64-bit little-endian ELF shared library, or None."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dyn = [], None
    for i in range(phnum):
        p_type, _fl, p_off, p_vaddr, _pa, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_off, p_filesz))
        elif p_type == 2:
            dyn = (p_off, p_filesz)
    if dyn is None:
        return None
    strtab = name = None
    for i in range(dyn[0], dyn[0] + dyn[1], 16):
        tag, val = struct.unpack_from("<qQ", data, i)
        if tag == 0:
            break
        if tag == 5:
            strtab = val
        elif tag == 14:
            name = val
    if strtab is None or name is None:
        return None
    for vaddr, off, size in loads:  # DT_STRTAB is an address: map it to a file offset
        if vaddr <= strtab < vaddr + size:
            start = off + (strtab - vaddr) + name
            return data[start:data.index(b"\0", start)].decode()
    return None


def sonames(dirs: list[str]) -> int:
    """Print 'SONAME PATH' for each shared library file in dirs (symlinks resolved, each once)."""
    seen = set()
    for d in dirs:
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            real = os.path.realpath(path)
            if ".so" not in name or real in seen or not os.path.isfile(real):
                continue
            seen.add(real)
            try:
                so = soname(real)
            except (OSError, struct.error, ValueError):
                so = None
            if so:
                print(so, real)
    return 0


# ---------------------------------------------------------------- archives
def _extract_one(job: tuple[str, str]) -> tuple[str, float, int]:
    archive, dest = job
    t = time.time()
    os.makedirs(dest, exist_ok=True)
    n = 0
    with tarfile.open(archive, "r:*") as tf:
        members = tf.getmembers()
        n = len(members)
        if hasattr(tarfile, "tar_filter"):
            tf.extractall(dest, members=members, filter="tar")
        else:
            tf.extractall(dest, members=members)
    return archive, time.time() - t, n


def extract(jobs: list[tuple[str, str]]) -> int:
    # biggest first, so the longest one starts at once
    jobs = sorted(jobs, key=lambda j: -os.path.getsize(j[0]))
    with cf.ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as ex:
        for archive, secs, n in ex.map(_extract_one, jobs):
            print(f"  extracted {os.path.basename(archive)} ({os.path.getsize(archive) / 2**20:.1f} MiB, "
                  f"{n} members) in {secs:.1f}s", flush=True)
    return 0


class _HashedParts(io.RawIOBase):
    """The concatenation of ``parts`` as one readable stream, hashed as it is read."""

    def __init__(self, parts: list[str]) -> None:
        self._parts = list(parts)
        self._file = None
        self.hash = hashlib.sha256()
        self.bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:  # type: ignore[no-untyped-def]
        while True:
            if self._file is None:
                if not self._parts:
                    return 0
                self._file = open(self._parts.pop(0), "rb")
            n = self._file.readinto(buf)
            if n:
                self.hash.update(memoryview(buf)[:n])
                self.bytes += n
                return n
            self._file.close()
            self._file = None


def unpack_stream(dest: str, want: str, done: str, parts: list[str],
                  site: str | None = None) -> int:
    t = time.time()
    os.makedirs(dest, exist_ok=True)
    raw = _HashedParts(parts)
    n = 0
    with tarfile.open(fileobj=io.BufferedReader(raw, 1 << 22), mode="r|*") as tf:
        for member in tf:
            if hasattr(tarfile, "tar_filter"):
                tf.extract(member, dest, filter="tar")
            else:
                tf.extract(member, dest)
            n += 1
    while raw.readinto(bytearray(1 << 20)):  # hash any padding after the tar's end
        pass
    got = raw.hash.hexdigest()
    if got != want:
        print(f"SHA256 MISMATCH for {parts[0]}..: {got} != {want}", flush=True)
        return 1
    if site is not None:
        wheels = sorted(os.path.join(dest, w) for w in os.listdir(dest) if w.endswith(".whl"))
        if install_wheels(site, wheels):
            return 1
    with open(done, "w") as f:
        f.write(f"{n} members, {raw.bytes} bytes, {time.time() - t:.1f}s\n")
    print(f"unpacked {len(parts)} parts ({raw.bytes / 2**20:.0f} MiB, {n} members) in "
          f"{time.time() - t:.1f}s", flush=True)
    return 0


def _install_wheel(job: tuple[str, str]) -> tuple[str, float, int]:
    """One wheel into ``site``: its files at the root, ``*.data/{purelib,platlib}`` merged there,
    ``*.data/scripts`` into ``site/bin``, other ``*.data`` dropped; Unix modes kept (ptxas, the
    Mooncake binaries are executables)."""
    wheel, site = job
    t = time.time()
    n = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            top, _, rest = name.partition("/")
            if top.endswith(".data"):
                kind, _, rest = rest.partition("/")
                if kind in ("purelib", "platlib"):
                    name = rest
                elif kind == "scripts":
                    name = "bin/" + rest
                else:
                    continue
            if not name or name.endswith("/"):
                continue
            path = os.path.join(site, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"  # wheels share files (nvidia/__init__.py)
            with zf.open(info) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(tmp, mode or 0o644)
            os.replace(tmp, path)
            n += 1
    return wheel, time.time() - t, n


def install_wheels(site: str, wheels: list[str]) -> int:
    """Install ``wheels`` into ``site`` in parallel, biggest first; 1 if any failed."""
    os.makedirs(site, exist_ok=True)
    jobs = sorted(((w, site) for w in wheels), key=lambda j: -os.path.getsize(j[0]))
    t, failed = time.time(), 0
    with cf.ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
        futures = {ex.submit(_install_wheel, j): j[0] for j in jobs}
        for fut in cf.as_completed(futures):
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - say which wheel, go on with the others
                print(f"FAILED {os.path.basename(futures[fut])}: {exc!r}", flush=True)
                failed = 1
    print(f"installed {len(wheels)} wheels into {site} in {time.time() - t:.1f}s", flush=True)
    return failed


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "extract":
        return extract([tuple(a.split("=", 1)) for a in args])
    if cmd == "unpack-stream":
        site = None
        if "--install-wheels" in args:
            i = args.index("--install-wheels")
            site, args = args[i + 1], args[:i] + args[i + 2:]
        return unpack_stream(args[0], args[1], args[2], args[3:], site)
    if cmd == "install-wheels":
        return install_wheels(args[0], args[1:])
    if cmd == "fatbin-list":
        for a in args:
            fatbin_list(a)
        return 0
    if cmd == "fatbin-prune":
        fatbin_prune(args[0], args[1], int(args[2]) if len(args) > 2 else 90,
                     args[3] if len(args) > 3 else None)
        return 0
    if cmd == "fatbin-unprune":
        unprune(args[0], args[1], args[2])
        print(f"rebuilt {args[2]} from {args[0]} + {args[1]} (sha256 matches the original)")
        return 0
    if cmd == "fatbin-check":
        return fatbin_check(args[0])
    if cmd == "sonames":
        return sonames(args)
    if cmd == "sha256":
        for a in args:
            print(sha256(a), a)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
