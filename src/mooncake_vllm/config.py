"""Mooncake store configuration: both shapes people have, validated all at once.

Accepted shapes (``MOONCAKE_CONFIG_PATH`` file, a path, or a mapping):

* the V0 ``mooncake.json`` (vLLM 0.8.3-0.10.0): ``local_hostname``, ``metadata_server``,
  ``protocol``, ``device_name``, ``master_server_address`` and integer sizes;
* the V1 ``mooncake_config.json`` (the seed; vLLM's in-tree connector): no
  ``local_hostname``, sizes as ints or strings such as ``"2GB"`` or ``"2147483648"``.

Every problem is collected and reported together in one :class:`ConfigError`.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_vllm.addresses import HostPort, MetadataURL
from mooncake_vllm.errors import ConfigError, ConfigProblem
from mooncake_vllm.files import read_regular

__all__ = [
    "CONFIG_ENV",
    "EXAMPLE_CONFIG",
    "IGNORED_KEYS",
    "TIER_SWITCHES",
    "StoreConfig",
    "load_store_config",
    "metadata_scheme",
    "parse_size",
    "read_config_data",
]

CONFIG_ENV = "MOONCAKE_CONFIG_PATH"

#: What a working file looks like; quoted in errors about a missing config.
EXAMPLE_CONFIG = """{
  "metadata_server": "http://127.0.0.1:8092/metadata",
  "master_server_address": "127.0.0.1:50063",
  "global_segment_size": "0",
  "local_buffer_size": "2147483648",
  "protocol": "tcp",
  "device_name": ""
}"""

_DEFAULT_SEGMENT = 3355443200  # vLLM V0's default
_DEFAULT_BUFFER = 1073741824
_MAX_SIZE = 1 << 50  # 1 PiB: anything larger is a typo
#: largest config file read (a Mooncake config is a few hundred bytes)
MAX_CONFIG_BYTES = 1 << 20
_PROTOCOLS = ("tcp", "rdma", "efa", "cxl", "ascend")
#: Keys other tools write into real Mooncake config files that we accept and ignore,
#: with what each does here (docs/configuration.md lists them). None of them is an
#: isolation or safety setting: ``tenant_id`` is one, so it is used (key namespace).
IGNORED_KEYS: dict[str, str] = {
    "mode": "the P2P demo's role switch; roles come from kv_role here",
    "metadata_backend": "LMCache's backend name; metadata_server alone decides it here",
    "prefill_url": "the P2P demo's proxy wiring; `mooncake-vllm proxy` takes it on its command line",
    "decode_url": "the P2P demo's proxy wiring; `mooncake-vllm proxy` takes it on its command line",
    "enable_client_http_server": "Mooncake client's own metrics HTTP server; not started here",
    "client_http_port": "Mooncake client's own metrics HTTP server; not started here",
}
#: the disk-tier switches: Mooncake's own ``setup`` spelling and vLLM's in-tree one (same meaning)
TIER_SWITCHES = ("enable_ssd_offload", "enable_offload")
_KNOWN_KEYS = {
    "local_hostname", "metadata_server", "master_server_address", "global_segment_size",
    "local_buffer_size", "protocol", "device_name", "tenant_id", "ssd_offload_path", *TIER_SWITCHES,
    *IGNORED_KEYS,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


@dataclass(frozen=True)
class StoreConfig:
    """A validated Mooncake store configuration."""

    local_hostname: str  # "" = the address that routes to the master (chosen at connect)
    metadata_server: str
    master_server_address: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str
    source: str = "dict"
    #: joins the block key namespace: two tenants never read each other's blocks
    tenant_id: str = ""
    #: the pool has a disk tier behind its DRAM (``enable_ssd_offload`` / ``enable_offload``):
    #: a pure client retries puts that find DRAM full of values not yet on disk; a process
    #: holding memory (``global_segment_size`` > 0) offloads its segment to ``ssd_offload_path``
    ssd_offload: bool = False
    ssd_offload_path: str = ""

    @property
    def metadata_scheme(self) -> str:
        """``"http"``, ``"etcd"``, ``"p2p"`` or ``"redis"``."""
        return metadata_scheme(self.metadata_server)

    @property
    def master_host_port(self) -> tuple[str, int]:
        hp = HostPort.parse(self.master_server_address, field="master_server_address")
        return hp.host, hp.port


def metadata_scheme(url: str) -> str:
    """Classify a metadata connection string the way Mooncake's parser does
    (:attr:`~mooncake_vllm.addresses.MetadataURL.kind`; a bare host:port is etcd)."""
    return MetadataURL.parse(url).kind


def parse_size(value: Any, *, field: str) -> int:
    """Parse a byte size: an int, or a string like ``"2GB"``, ``"512 MB"``, ``"2147483648"``.

    Units are 1024-based and case-insensitive (``K/KB/KiB`` … ``T/TB/TiB``).
    Raises :class:`ValueError` naming ``field`` on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a size, found the boolean {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match or (match.group(2) or "").lower() not in _UNITS:
            raise ValueError(
                f"{field} must be a byte count or a size like \"2GB\", found {value!r}"
            )
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    else:
        raise ValueError(f"{field} must be an int or a string like \"2GB\", found {value!r}")
    if size < 0:
        raise ValueError(f"{field} must not be negative, found {value!r}")
    if size > _MAX_SIZE:
        raise ValueError(f"{field} is absurdly large ({value!r} > 1 PiB)")
    return size


def _read_source(
    source: str | os.PathLike[str] | Mapping[str, Any] | None, env: Mapping[str, str]
) -> tuple[Mapping[str, Any], str]:
    if isinstance(source, Mapping):
        return source, "dict"
    if source is None:
        path_text = env.get(CONFIG_ENV, "")
        if not path_text:
            raise ConfigError(CONFIG_ENV, [ConfigProblem(
                CONFIG_ENV, "is not set",
                f"export {CONFIG_ENV}=/path/to/mooncake_config.json, a file like:\n"
                f"{EXAMPLE_CONFIG}",
            )])
        label = f"{CONFIG_ENV}={path_text}"
    else:
        path_text = os.fspath(source)
        label = path_text
    path = Path(path_text)
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES)  # a FIFO or /dev/zero: an error, never a hang or MemoryError
    except OSError as exc:
        raise ConfigError(label, [ConfigProblem(
            CONFIG_ENV if source is None else "path",
            f"cannot read {path_text!r}: {exc.strerror or exc}",
            f"point {CONFIG_ENV} at a readable JSON file like:\n{EXAMPLE_CONFIG}",
        )]) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(label, [ConfigProblem(
            "<file>", f"is not valid JSON ({exc})", f"write a JSON object like:\n{EXAMPLE_CONFIG}"
        )]) from None
    if not isinstance(data, dict):
        raise ConfigError(label, [ConfigProblem(
            "<file>", f"must hold a JSON object, found {type(data).__name__}",
            f"write a JSON object like:\n{EXAMPLE_CONFIG}",
        )])
    return data, label


def read_config_data(source: str | os.PathLike[str] | Mapping[str, Any] | None = None, *,
                     env: Mapping[str, str] | None = None) -> tuple[Mapping[str, Any], str]:
    """The raw mapping of a config (``None``: ``$MOONCAKE_CONFIG_PATH``) and its label, unvalidated
    (a holder takes some of its keys and sets its own sizes); :class:`ConfigError` if unreadable."""
    return _read_source(source, os.environ if env is None else env)


def _etcd_ok(url: str) -> bool:
    try:
        MetadataURL.parse(url).etcd_endpoints()
    except ConfigError:
        return False
    return True


def load_store_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> StoreConfig:
    """Load and validate a Mooncake config; ``None`` reads ``$MOONCAKE_CONFIG_PATH``."""
    env = os.environ if env is None else env
    data, label = _read_source(source, env)
    problems: list[ConfigProblem] = []

    def text(name: str, default: str | None) -> str:
        value = data.get(name, default)
        if value is None:
            problems.append(ConfigProblem(name, "is missing", f'add "{name}" to the config'))
            return ""
        if not isinstance(value, str):
            problems.append(ConfigProblem(
                name, f"must be a string, found {type(value).__name__} {value!r}",
                f'write it as "{name}": "..."'))
            return ""
        return value.strip()

    def size(name: str, default: int) -> int | None:
        try:
            return parse_size(data.get(name, default), field=name)
        except ValueError as exc:
            problems.append(ConfigProblem(name, str(exc).removeprefix(f"{name} "),
                                          f'write e.g. "{name}": "2GB" or a byte count'))
            return None

    for key in sorted(set(data) - _KNOWN_KEYS):
        close = difflib.get_close_matches(key, sorted(_KNOWN_KEYS), n=1)
        problems.append(ConfigProblem(
            key, "is not a Mooncake store setting",
            f'rename it to "{close[0]}"' if close else "remove it, or check its spelling"))
    hostname = text("local_hostname", "")  # "" = chosen at connect time
    metadata = text("metadata_server", None)
    master = text("master_server_address", None)
    segment = size("global_segment_size", _DEFAULT_SEGMENT)
    buffer = size("local_buffer_size", _DEFAULT_BUFFER)
    protocol = text("protocol", "tcp")
    device = text("device_name", "")
    raw_tenant = data.get("tenant_id")
    if isinstance(raw_tenant, int) and not isinstance(raw_tenant, bool):
        tenant = str(raw_tenant)  # a numeric tenant id names the same tenant as its digits
    else:
        tenant = text("tenant_id", "")
    if "|" in tenant or not tenant.isprintable():
        problems.append(ConfigProblem("tenant_id", f"must be printable text without '|', found {tenant!r}",
                                      "use a name such as \"team-a\" (it joins the key namespace)"))

    if metadata:
        scheme = metadata_scheme(metadata)
        if scheme not in {"http", "etcd", "p2p", "redis"}:
            problems.append(ConfigProblem(
                "metadata_server", f"has the unsupported scheme {scheme!r} in {metadata!r} "
                "(Mooncake aborts the process on an unknown scheme)",
                'use "http://host:port/metadata", "etcd://host:port", "P2PHANDSHAKE" '
                'or "redis://host:port"'))
        elif scheme == "etcd" and not _etcd_ok(metadata):
            problems.append(ConfigProblem(
                "metadata_server", f"{metadata!r} is not etcd host:port endpoints",
                'write "etcd://host:2379" (several: "etcd://h1:2379,h2:2379")'))
    if master and not master.startswith("etcd://") and HostPort.try_parse(master) is None:
        problems.append(ConfigProblem(
            "master_server_address", f"must be host:port, found {master!r}",
            'write e.g. "127.0.0.1:50051"'))
    if protocol and protocol not in _PROTOCOLS:
        hint = f' (did you mean "{protocol.lower()}"?)' if protocol.lower() in _PROTOCOLS else ""
        problems.append(ConfigProblem(
            "protocol", f"must be one of {', '.join(_PROTOCOLS)}, found {protocol!r}{hint}",
            'use "tcp" (works everywhere) or "rdma" with device_name set'))
    if protocol == "rdma" and device == "" and data.get("device_name") is None:
        pass  # vLLM's own default; RDMA auto-discovery decides. The checker warns.
    if buffer == 0 and "local_buffer_size" in data:
        problems.append(ConfigProblem(
            "local_buffer_size", "is 0, so every put fails",
            'give the staging buffer some room, e.g. "local_buffer_size": "512MB"'))
    ssd, ssd_path = _tier(data, segment, problems, env)
    if problems:
        raise ConfigError(label, problems)
    return StoreConfig(
        local_hostname=hostname, metadata_server=metadata, master_server_address=master,
        global_segment_size=segment or 0, local_buffer_size=buffer or 0, protocol=protocol,
        device_name=device, source=label, tenant_id=tenant, ssd_offload=ssd, ssd_offload_path=ssd_path,
    )


def _flag(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"true", "false", "1", "0"}:
        return value.strip().lower() in {"true", "1"}
    return None


#: Mooncake's own spelling of the offload directory (``setup``'s ``ssd_offload_path`` wins over it)
OFFLOAD_PATH_ENV = "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"


def _tier(data: Mapping[str, Any], segment: int | None, problems: list[ConfigProblem],
          env: Mapping[str, str]) -> tuple[bool, str]:
    """``enable_ssd_offload`` / ``enable_offload`` and ``ssd_offload_path``: honoured where they
    mean something for this process, refused (with the fix) where they cannot work."""
    switches = {}
    for name in TIER_SWITCHES:
        if name in data:
            switches[name] = _flag(data[name])
            if switches[name] is None:
                problems.append(ConfigProblem(name, f"must be true or false, found {data[name]!r}",
                                              f'write "{name}": true (the pool has a disk tier) or false'))
    known = {v for v in switches.values() if v is not None}
    if len(known) > 1:
        problems.append(ConfigProblem("enable_offload", "contradicts enable_ssd_offload (both name the disk tier)",
                                      "keep one of them"))
    ssd = True in known
    path = data.get("ssd_offload_path", "")
    if not isinstance(path, str):
        problems.append(ConfigProblem("ssd_offload_path", f"must be a string, found {type(path).__name__}",
                                      'write "ssd_offload_path": "/abs/dir"'))
        return ssd, ""
    path = path.strip()
    holds = bool(segment)
    if ssd and holds and not path:
        path = env.get(OFFLOAD_PATH_ENV, "").strip()  # where vLLM's in-tree connector leaves it
    if path and not ssd:
        problems.append(ConfigProblem(
            "ssd_offload_path", "is set but the disk tier is off, so nothing would be written there",
            'add "enable_ssd_offload": true, or remove ssd_offload_path'))
    elif path and not holds:
        problems.append(ConfigProblem(
            "ssd_offload_path", "is set in a pure client (global_segment_size 0): it holds no pool memory, "
            "so nothing is offloaded from it (Mooncake offloads a value to the disk of the process holding it)",
            "give the directory to the holder (`mooncake-vllm up --ssd DIR`, `mooncake-vllm holder --ssd DIR`, "
            "or mooncake_client --enable_offload with MOONCAKE_OFFLOAD_FILE_STORAGE_PATH=DIR) and keep "
            '"enable_ssd_offload": true here (docs/ssd-tier.md)'))
    elif path and not os.path.isabs(path):
        problems.append(ConfigProblem("ssd_offload_path", f"must be an absolute directory, found {path!r}",
                                      'write e.g. "ssd_offload_path": "/mnt/nvme/mooncake"'))
    elif ssd and holds and not path:
        problems.append(ConfigProblem(
            "ssd_offload_path", "is missing: this process holds pool memory (global_segment_size > 0) and "
            "enable_ssd_offload asks it to offload that memory to disk",
            f'add "ssd_offload_path": "/abs/dir" (a local disk with room; or export {OFFLOAD_PATH_ENV}), or set '
            '"global_segment_size": "0" and let a holder keep the tier'))
    return ssd, path
