"""``--probe``: live checks against the running services and this host.

Only run when asked: each touches the network, /sys or ``ldd``. Every network
call is bounded by ``Context.timeout``.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

from mooncake_vllm.addresses import HostPort
from mooncake_vllm.checker.catalogue import Rule
from mooncake_vllm.checker.context import Context, check
from mooncake_vllm.checker.model import Finding, Where
from mooncake_vllm.checker.rules_mooncake import metadata_urls
from mooncake_vllm.errors import ConfigError, StoreError, StoreUnavailableError
from mooncake_vllm.metadata.backends import MetadataBackend, backend_for
from mooncake_vllm.metadata.gc import DEAD, scan
from mooncake_vllm.metadata.gc import probe as tcp_probe

__all__ = ["IB_SYSFS", "is_local_address", "library_fix", "missing_libraries", "mooncake_package_dir"]

#: where the kernel lists RDMA devices
IB_SYSFS = "/sys/class/infiniband"
_PROBE_KEY = "mooncake/mooncake-vllm-check-probe"
_LIB_FIXES = {
    "libibverbs": "apt-get install libibverbs1 (needed even by the -non-cuda wheel)",
    "libnuma": "apt-get install libnuma1",
    "libcurl": "apt-get install libcurl4",
    "libjsoncpp": "apt-get install libjsoncpp25",
    "libcudart.so.12": "on a CPU host install mooncake-transfer-engine-non-cuda; on CUDA 12 install the CUDA runtime",
    "libcudart.so.13": "install the CUDA 13 runtime, or the wheel matching your CUDA (mooncake-transfer-engine-cuda13)",
    "libcuda.so": "install the NVIDIA driver, or mooncake-transfer-engine-non-cuda on a CPU host",
}


@check("MCV-E101")
def master_unreachable(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    seen = set()
    for config in ctx.deployment.configs:
        address = str(config.data.get("master_server_address") or "")
        hp = HostPort.try_parse(address, default_host="127.0.0.1") if not address.startswith("etcd://") else None
        if hp is None or hp in seen:
            continue
        seen.add(hp)
        reason = tcp_probe(hp.host, hp.port, ctx.timeout)
        if reason:
            yield ctx.finding(rule, config.where("master_server_address"), address=address, reason=reason)


def _backends(ctx: Context) -> Iterator[tuple[str, Where, MetadataBackend]]:
    """A client for each distinct metadata server (P2PHANDSHAKE and bad URLs skipped), closed afterwards."""
    for url, where in dict(metadata_urls(ctx)).items():
        try:
            backend = backend_for(url, timeout=ctx.timeout)
        except (ConfigError, ValueError):
            continue  # other rules report bad URLs; P2PHANDSHAKE has no server
        try:
            yield url, where, backend
        finally:
            backend.close()


@check("MCV-E102")
def metadata_unreachable(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    for url, where, backend in _backends(ctx):
        try:
            backend.get(_PROBE_KEY)
        except StoreUnavailableError as exc:
            yield ctx.finding(rule, where, url=url, reason=str(exc).split(";")[0])
        except StoreError:
            pass  # it answered
        except (ValueError, OSError) as exc:  # an address the client cannot even use (e.g. bare "::1")
            yield ctx.finding(rule, where, url=url, reason=f"unusable address ({exc})")


@check("MCV-W101")
def stale_metadata(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    for url, where, backend in _backends(ctx):
        try:
            dead = [s for s in scan(backend, timeout=ctx.timeout) if s.state == DEAD]
        except (StoreError, StoreUnavailableError, ValueError, OSError):
            continue  # not listable (Mooncake's own HTTP server), down or unusable (MCV-E102)
        if dead:
            names = ", ".join(s.segment for s in dead[:5]) + (" ..." if len(dead) > 5 else "")
            yield ctx.finding(rule, where, count=len(dead), segments=names, url=url)


@check("MCV-E103")
def rdma_device_missing(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    try:
        present = sorted(os.listdir(IB_SYSFS))
    except OSError:
        present = []
    for config in ctx.deployment.configs:
        if str(config.data.get("protocol", "")).lower() != "rdma":
            continue
        wanted = [d.strip() for d in str(config.data.get("device_name") or "").split(",") if d.strip()]
        wanted = [d for d in wanted if d != "auto-discovery"]
        if not present:
            yield ctx.finding(rule, config.where("protocol"), problem=f"this host has no RDMA devices ({IB_SYSFS} "
                                                                      "is empty or missing)")
        elif missing := [d for d in wanted if d not in present]:
            yield ctx.finding(rule, config.where("device_name"),
                              problem=f"device(s) {', '.join(missing)} are not present (found: {', '.join(present)})")


def mooncake_package_dir() -> Path | None:
    """Directory of the installed ``mooncake`` package, found without importing it."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def missing_libraries(directory: Path) -> dict[str, list[str]]:
    """``{extension .so: [missing libs]}`` for the shared objects in ``directory``, per ``ldd``."""
    ldd = shutil.which("ldd")
    if ldd is None:  # Defensive: every glibc system has it
        return {}
    found: dict[str, list[str]] = {}
    for so in sorted(directory.glob("*.so*")):
        try:
            out = subprocess.run([ldd, str(so)], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        missing = re.findall(r"^\s*(\S+)\s+=>\s+not found", out, re.MULTILINE)
        if missing:
            found[so.name] = sorted(set(missing))
    return found


def library_fix(missing: list[str]) -> str:
    """The install command(s) for missing libraries."""
    fixes = [fix for lib in missing for key, fix in _LIB_FIXES.items() if lib.startswith(key)]
    return "; ".join(dict.fromkeys(fixes)) or "install the packages providing " + ", ".join(missing)


@check("MCV-E104")
def mooncake_libraries_missing(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    directory = mooncake_package_dir()
    if directory is None:
        return
    for lib, missing in missing_libraries(directory).items():
        yield ctx.finding(rule, None, lib=f"mooncake/{lib}", missing=", ".join(missing), fix=library_fix(missing))


def is_local_address(host: str) -> bool:
    """True when ``host`` resolves to an address this machine can bind."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
                return True
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                return True  # bindable in principle (e.g. permission), so it is ours
    return False


@check("MCV-W102")
def local_hostname_not_local(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    for config in ctx.deployment.configs:
        value = str(config.data.get("local_hostname") or "").strip()
        host = value.rsplit(":", 1)[0] if value.count(":") == 1 else value.strip("[]")
        if host and not is_local_address(host):
            yield ctx.finding(rule, config.where("local_hostname"), host=value)
