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
from mooncake_vllm.checker.model import MASTER, Finding, Where
from mooncake_vllm.checker.rules_fleet import DEFAULT_CLIENT_TTL, MIN_CLIENT_TTL
from mooncake_vllm.checker.rules_mooncake import metadata_urls
from mooncake_vllm.errors import ConfigError, StoreError, StoreUnavailableError
from mooncake_vllm.inventory import pool_tiers, scan_pool, splits
from mooncake_vllm.metadata.backends import MetadataBackend, backend_for
from mooncake_vllm.metadata.gc import DEAD, master_segments, scan
from mooncake_vllm.metadata.gc import probe as tcp_probe

__all__ = ["IB_SYSFS", "P2P_CONNECTOR", "is_local_address", "library_fix", "local_master",
           "master_http_url", "missing_libraries", "mooncake_package_dir", "p2p_protocol",
           "rdma_devices"]

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


#: vLLM's in-tree P2P connector (a MultiConnector child in the seed's second recipe)
P2P_CONNECTOR = "MooncakeConnector"


def rdma_devices() -> list[str]:
    """The RDMA devices this host lists (none: ``[]``)."""
    try:
        return sorted(os.listdir(IB_SYSFS))
    except OSError:
        return []


def p2p_protocol(connector: dict) -> str:
    """The Transfer Engine protocol a P2P ``MooncakeConnector`` entry asks for (vLLM's default rdma)."""
    extra = connector.get("kv_connector_extra_config")
    value = extra.get("mooncake_protocol") if isinstance(extra, dict) else None
    return str(value or "rdma").lower()


@check("MCV-E103")
def rdma_device_missing(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    present = rdma_devices()
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


@check("MCV-E105")
def p2p_rdma_without_device(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe or rdma_devices():
        return
    for launch in ctx.deployment.instances:
        if any(c.get("kv_connector") == P2P_CONNECTOR and p2p_protocol(c) == "rdma"
               for c in launch.connectors()):
            reads = ctx.vllm is None or ctx.vllm.p2p_protocol_key
            yield ctx.finding(rule, launch.where, instance=launch.model or launch.program,
                              how=("add \"kv_connector_extra_config\": {\"mooncake_protocol\": \"tcp\"} "
                                   "to the MooncakeConnector entry (`--fix OUTDIR` writes it)") if reads else
                                  ("target vLLM >= 0.24.0, whose MooncakeConnector reads "
                                   "kv_connector_extra_config.mooncake_protocol, then set it to \"tcp\"; "
                                   "or drop the P2P half (the store carries the KV: --flow store)"))


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


# -- the live master: client_ttl and how many processes hold the pool (issue 13 item 5) ----------------------
_DEFAULT_RPC_PORT, _DEFAULT_METRICS_PORT = 50051, 9003


def _gflag(argv: list[str], *names: str) -> str | None:
    """The value of a gflags-style flag (``--name=v``, ``-name=v``, ``--name v``) in ``argv``."""
    for i, arg in enumerate(argv):
        key, eq, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and key in names:
            if eq:
                return value
            if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                return argv[i + 1]
    return None


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a master address (bare ``host:port``), or ``None``."""
    hp = HostPort.try_parse(address, default_host="127.0.0.1")
    return (hp.host, hp.port) if hp is not None else None


def local_master(address: str, proc_root: str = "/proc") -> tuple[int, list[str]] | None:
    """``(pid, argv)`` of the mooncake_master on this host serving ``address`` (its RPC host:port), if any."""
    hp = _host_port(address)
    if hp is None or not is_local_address(hp[0]):
        return None
    try:
        pids = [p for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(os.path.join(proc_root, pid, "cmdline"), "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read(1 << 16).split(b"\0") if a]
        except OSError:
            continue
        if not argv or os.path.basename(argv[0]) != "mooncake_master":
            continue
        port = _gflag(argv, "rpc_port", "port") or str(_DEFAULT_RPC_PORT)
        if port.isdigit() and int(port) == hp[1]:
            return int(pid), argv
    return None


def _masters(ctx: Context) -> Iterator[tuple[str, Where]]:
    seen = set()
    for config in ctx.deployment.configs:
        address = str(config.data.get("master_server_address") or "")
        if address and not address.startswith("etcd://") and address not in seen:
            seen.add(address)
            yield address, config.where("master_server_address")


@check("MCV-W103")
def live_client_ttl_short(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    for address, where in _masters(ctx):
        found = local_master(address)
        if found is None:
            continue  # another host: its command line is not visible from here
        pid, argv = found
        try:
            ttl = float(_gflag(argv, "client_ttl") or DEFAULT_CLIENT_TTL)
        except ValueError:
            continue
        if ttl < MIN_CLIENT_TTL:
            yield ctx.finding(rule, where, address=address, pid=pid, ttl=f"{ttl:g}")


def master_http_url(address: str, launched_port: str | None = None) -> str | None:
    """The HTTP (metrics) address of the master serving ``address``: from its command line when
    it runs here, else ``launched_port`` (a launch script's), else Mooncake's default :9003."""
    hp = _host_port(address)
    if hp is None:
        return None
    host, port = hp[0], launched_port or str(_DEFAULT_METRICS_PORT)
    found = local_master(address)
    if found is not None:
        metrics_host = _gflag(found[1], "metrics_host")
        if metrics_host and metrics_host not in ("0.0.0.0", "::"):
            host = metrics_host
        port = _gflag(found[1], "metrics_port") or str(_DEFAULT_METRICS_PORT)
    return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"


def _metrics_url(ctx: Context, address: str) -> str | None:
    """The master's HTTP address: from its command line when it runs here, else the scripts' master, else :9003."""
    launched = [m.option("--metrics-port") for m in ctx.deployment.of_kind(MASTER)]
    return master_http_url(address, next((p for p in launched if p), None))


def _master_views(ctx: Context) -> Iterator[tuple[Where, str]]:
    """(where, HTTP address) of each configured master whose address has a host:port."""
    for address, where in _masters(ctx):
        url = _metrics_url(ctx, address)
        if url is not None:
            yield where, url


@check("MCV-W104")
def live_pool_in_one_holder(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    for where, url in _master_views(ctx):
        try:
            segments = master_segments(url, ctx.timeout)
        except StoreUnavailableError:
            continue  # no HTTP view of this master (MCV-E101 reports an unreachable one)
        if len(segments) == 1:
            yield ctx.finding(rule, where, url=url, segment=next(iter(segments)))


#: keys a --probe lists at most per master (the listing is streamed and counted, never kept)
PROBE_MAX_KEYS = 200_000


@check("MCV-W105")
def live_namespaces_split(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    for where, url in _master_views(ctx):
        try:
            inv = scan_pool(url, timeout=ctx.timeout, max_keys=PROBE_MAX_KEYS, sizes=False)
        except StoreUnavailableError:
            continue  # no HTTP view of this master (MCV-E101 reports an unreachable one)
        for split in splits(inv):
            yield ctx.finding(rule, where, url=url, split=split.text())


@check("MCV-W106")
def live_ssd_tier_missing(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not ctx.probe:
        return
    from mooncake_vllm.checker.rules_mooncake import tier_configs

    asked = {str(c.data.get("master_server_address") or ""): c for c, _ in tier_configs(ctx)}
    for address, where in _masters(ctx):
        config = asked.get(address)
        url = _metrics_url(ctx, address) if config is not None else None
        if config is None or url is None:
            continue
        try:
            tiers = pool_tiers(url, timeout=ctx.timeout)
        except StoreUnavailableError:
            continue  # no HTTP view of this master (MCV-E101 reports an unreachable one)
        if not tiers.get("disk_capacity_bytes"):
            detail = ("master_total_file_capacity_bytes 0" if "disk_capacity_bytes" in tiers
                      else "its /metrics has no disk series")
            yield ctx.finding(rule, where, config=config.path, url=url, detail=detail)
