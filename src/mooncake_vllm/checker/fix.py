"""``--fix OUTDIR``: write the migrated V1 ``mooncake_config.json`` and ``launch_v1.sh``.

The launch script keeps every instance (model, port, GPUs, options), drops what
the V1 engine does not take (``VLLM_USE_V1``, V0-only flags, rejected
kv-transfer keys), names mooncake-vllm's connector explicitly, and replaces the
demo proxy by ``mooncake-vllm proxy``. Producer/consumer deployments on RDMA
with a vLLM that has the V1 P2P ``MooncakeConnector`` get the seed's
``MultiConnector`` layout; otherwise the store carries the KV. Files are written
atomically (temp file + ``os.replace``), never with wider permissions than the
files they come from, and never overwritten without ``force`` (which keeps a
``.bak`` copy of each replaced file).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mooncake_vllm.checker.catalogue import OUR_MODULE_PATH
from mooncake_vllm.checker.context import Context
from mooncake_vllm.checker.model import HOLDER, MASTER, METADATA, PROXY, Launch, MooncakeConfigFile, Where
from mooncake_vllm.checker.probe import P2P_CONNECTOR, p2p_protocol, rdma_devices
from mooncake_vllm.checker.rules_engine import V0_ONLY_FLAGS
from mooncake_vllm.checker.rules_fleet import P2P_LAYOUT
from mooncake_vllm.checker.rules_mooncake import segment_size
from mooncake_vllm.config import CONFIG_ENV
from mooncake_vllm.errors import ConfigError, ConfigProblem

__all__ = ["CONFIG_NAME", "SCRIPT_NAME", "check_outdir", "migrated_config", "migrated_script", "output_modes",
           "write_migration"]

CONFIG_NAME = "mooncake_config.json"
SCRIPT_NAME = "launch_v1.sh"
_V0_SEGMENT, _V0_BUFFER = 3355443200, 1073741824  # vLLM V0 defaults (vllm §4)
_DROP_ENV = {"VLLM_USE_V1", CONFIG_ENV}
_DROP_OPTIONS = {"--kv-transfer-config", "--model", *V0_ONLY_FLAGS}
_BOOTSTRAP_PORT = 8998  # VLLM_MOONCAKE_BOOTSTRAP_PORT default (vllm §9)


def check_outdir(outdir: str | os.PathLike[str], *, force: bool) -> None:
    """Refuse (ConfigError) when OUTDIR holds our files and ``force`` is off, or is not a directory."""
    out = Path(outdir)
    if out.exists() and not out.is_dir():
        raise ConfigError("--fix", [ConfigProblem("--fix", f"{out} exists and is not a directory",
                                                  "give a new or existing directory")])
    existing = [str(out / n) for n in (CONFIG_NAME, SCRIPT_NAME) if (out / n).exists()]
    if existing and not force:
        raise ConfigError("--fix", [ConfigProblem("--fix", f"{', '.join(existing)} already exist(s)",
                                                  "pass --force to overwrite, or choose another OUTDIR")])


def _base_config(ctx: Context) -> MooncakeConfigFile | None:
    stores = [launch for launch in ctx.deployment.instances if launch.uses_store()]
    candidates = [c for launch in stores for c in ctx.deployment.configs_for(launch)] or ctx.deployment.configs
    return next((c for c in candidates if c.shape != "v0-pipe"), None)


def migrated_config(ctx: Context) -> dict[str, Any]:
    """The V1 ``mooncake_config.json`` for the target (keeps addresses, sizes and transport)."""
    base = _base_config(ctx)
    data = dict(base.data) if base else {}
    v0 = base is None or base.shape == "v0"
    metadata = str(data.get("metadata_server") or "http://127.0.0.1:8080/metadata")
    if metadata != "P2PHANDSHAKE" and "://" not in metadata:
        metadata = f"etcd://{metadata}"  # bare host:port always meant etcd (MCV-W001)
    out: dict[str, Any] = {}
    if data.get("local_hostname"):
        out["local_hostname"] = data["local_hostname"]
    out["metadata_server"] = metadata
    out["master_server_address"] = str(data.get("master_server_address") or "127.0.0.1:50051")
    out["global_segment_size"] = data.get("global_segment_size", _V0_SEGMENT if v0 else 4 << 30)
    out["local_buffer_size"] = data.get("local_buffer_size", _V0_BUFFER if v0 else 4 << 30)
    out["protocol"] = str(data.get("protocol") or "tcp")
    out["device_name"] = str(data.get("device_name") or "")
    if ctx.vllm is not None and ctx.vllm.store_mode_key:
        out["mode"] = "standalone-store" if segment_size(out["global_segment_size"]) == 0 else "embedded"
    return out


def _store_connector(ctx: Context, role: str) -> dict[str, Any]:
    conf: dict[str, Any] = {"kv_connector": "MooncakeStoreConnector", "kv_role": role}
    if ctx.vllm is None or ctx.vllm.module_path:
        conf["kv_connector_module_path"] = OUR_MODULE_PATH
    return conf


def _p2p_connector(ctx: Context, launch: Launch, role: str) -> dict[str, Any]:
    """The P2P child, its own extra config kept; on a host without an RDMA device (MCV-E105)
    its Transfer Engine runs on TCP where the target reads ``mooncake_protocol``."""
    old = next((c for c in launch.connectors() if c.get("kv_connector") == P2P_CONNECTOR), {})
    extra = dict(old.get("kv_connector_extra_config") or {})
    if (p2p_protocol(old) == "rdma" and not rdma_devices()
            and (ctx.vllm is None or ctx.vllm.p2p_protocol_key)):
        extra["mooncake_protocol"] = "tcp"
    conf: dict[str, Any] = {"kv_connector": P2P_CONNECTOR, "kv_role": role}
    if extra:
        conf["kv_connector_extra_config"] = extra
    return conf


def _kv_config(ctx: Context, launch: Launch, role: str, p2p: bool) -> dict[str, Any]:
    allowed = ctx.vllm.kv_config_fields if ctx.vllm else None
    kept = {k: v for k, v in (launch.kv_config or {}).items()
            if k not in ("kv_connector", "kv_role", "kv_connector_module_path", "kv_connector_extra_config")
            and (allowed is None or k in allowed)}
    if p2p:
        children = [_p2p_connector(ctx, launch, role), _store_connector(ctx, role)]
        return {"kv_connector": "MultiConnector", "kv_role": role, **kept,
                "kv_connector_extra_config": {"connectors": children}}
    conf = {**_store_connector(ctx, role), **kept}
    extra = (launch.kv_config or {}).get("kv_connector_extra_config")
    if isinstance(extra, dict) and "connectors" not in extra:
        conf["kv_connector_extra_config"] = extra
    return conf


def _role(launch: Launch) -> str:
    return next(iter(launch.roles()), "kv_both")


def _line(env: dict[str, str], argv: list[str], background: bool = True) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (f"{prefix} " if prefix else "") + " ".join(shlex.quote(a) for a in argv) + (" &" if background else "")


def _instance_line(ctx: Context, launch: Launch, p2p: bool, bootstrap: int | None,
                   beside_pairs: bool = False) -> str:
    env = {k: v for k, v in launch.prefix_env.items() if k not in _DROP_ENV}
    if bootstrap is not None:
        env.setdefault("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(bootstrap))
    if beside_pairs and not p2p:  # MCV-W031: key by the pairs' KV layout (their P2P child's HND)
        env.setdefault("VLLM_KV_CACHE_LAYOUT", P2P_LAYOUT)
    argv = ["vllm", "serve", launch.model or "MODEL"]
    for name, value in launch.options.items():
        if name not in _DROP_OPTIONS:
            argv += [name] + ([value] if value else [])
    role = _role(launch)
    argv += ["--kv-transfer-config", json.dumps(_kv_config(ctx, launch, role, p2p), separators=(",", ":"))]
    return _line(env, argv)


def migrated_script(ctx: Context, config_name: str = CONFIG_NAME) -> str:
    """The V1 launch script (bash) for the deployment."""
    dep = ctx.deployment
    config = migrated_config(ctx)
    instances = [launch for launch in dep.instances if launch.kind != "environment"]
    roles = {_role(launch) for launch in instances}
    pd = {"kv_producer", "kv_consumer"} <= roles
    p2p = (pd and ctx.vllm is not None and ctx.vllm.in_tree_mooncake_connector == "v1-p2p"
           and config["protocol"] == "rdma")
    target = f"vLLM {ctx.vllm.release}" if ctx.vllm else "vLLM (V1)"
    lines = [
        "#!/usr/bin/env bash",
        "# Written by `mooncake-vllm check --fix` from: " + (", ".join(dep.sources) or "the current environment"),
        f"# Target: {target}, V1 engine; every process runs in the background of this one script.",
        "# Review hosts, ports and GPUs before use; run `mooncake-vllm check` on this directory afterwards.",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        f'export MOONCAKE_CONFIG_PATH="$HERE/{config_name}"',
    ]
    if ctx.vllm is not None and ctx.vllm.needs_shared_hash_seed:
        lines.append("export PYTHONHASHSEED=0  # one seed for every engine: vLLM < 0.29 block hashes depend on it")
    base = _base_config(ctx)
    lines.append(f"# {config_name} is derived from {base.path if base else 'defaults (no config found)'}")
    lines += ["", "# services"]
    for launch in dep.of_kind(METADATA, MASTER, HOLDER):
        lines.append(_line({k: v for k, v in launch.prefix_env.items() if k not in _DROP_ENV}, launch.argv))
    if not dep.of_kind(MASTER):
        host, _, port = config["master_server_address"].rpartition(":")
        lines.append(_line({}, ["mooncake_master", f"--rpc_port={port}", f"--rpc_address={host or '127.0.0.1'}"]))
    if segment_size(config["global_segment_size"]) == 0 and not dep.of_kind(HOLDER):
        lines.append('mooncake-vllm holder --config "$MOONCAKE_CONFIG_PATH" --segment-size 4GB &'
                     "  # segment 0: the pool lives here")
    lines += ["", "# vLLM instances (V1)"]
    prefill, decode = [], []
    old_proxy = next((p for p in dep.of_kind(PROXY) if p.program != "mooncake-vllm proxy"), None)
    old_hosts = {k: [h.split("://", 1)[-1] for h in (old_proxy.option(k) or "").split()] if old_proxy else []
                 for k in ("--prefill", "--decode")}
    for launch in instances or [Launch("vllm", [], {}, Where("template"))]:
        role = _role(launch)
        pair = p2p and role in ("kv_producer", "kv_consumer")
        bootstrap = _BOOTSTRAP_PORT + len(prefill) if pair and role == "kv_producer" else None
        lines.append(_instance_line(ctx, launch, pair, bootstrap, beside_pairs=p2p))
        bootstrap = launch.prefix_env.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", bootstrap)
        address = f"localhost:{launch.option('--port') or 8000}"
        if role == "kv_producer":
            known = old_hosts["--prefill"]
            address = known[len(prefill)] if len(known) > len(prefill) else address
            prefill.append(f"{address}@{bootstrap}" if bootstrap is not None else address)
        elif role == "kv_consumer":
            known = old_hosts["--decode"]
            decode.append(known[len(decode)] if len(known) > len(decode) else address)
    if pd or dep.of_kind(PROXY):
        lines += ["", f"# proxy (replaces {old_proxy.program})" if old_proxy else "# proxy"]
        model = next((launch.model for launch in instances if launch.model), "MODEL")
        argv = ["mooncake-vllm", "proxy", "--model", model, "--prefill", *(prefill or ["HOST:PORT"]),
                "--decode", *(decode or ["HOST:PORT"]),
                "--port", (old_proxy.option("--port") if old_proxy else None) or "8000"]
        if p2p and ctx.vllm is not None:
            argv += ["--flow", "p2p", "--target-vllm", ctx.vllm.release]
        if old_proxy is not None and old_proxy.env.get("ADMIN_API_KEY"):  # never copy the secret itself
            lines.append(': "${ADMIN_API_KEY:?export ADMIN_API_KEY (the proxy admin key) before running}"')
        lines.append(_line({}, argv))
    lines += ["", "wait", ""]
    return "\n".join(lines)


def _atomic_write(path: Path, text: str, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # created 0600: never wider meanwhile
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mode_of(paths: list[str]) -> int | None:
    """The permission bits every one of ``paths`` grants (their intersection); None when none is a file."""
    mode = None
    for name in dict.fromkeys(paths):
        try:
            bits = os.stat(name).st_mode & 0o777
        except (OSError, ValueError):
            continue
        mode = bits if mode is None else mode & bits
    return mode


def output_modes(ctx: Context) -> tuple[int, int]:
    """(config mode, script mode): never wider than the inputs they are made from.

    The config keeps its source config's bits (a 0600 config holding a redis
    password stays 0600); the script gets the bits every input grants (it may
    carry their variables, e.g. HF_TOKEN), plus execute wherever read is granted.
    The owner always keeps read/write (and execute on the script).
    """
    base = _base_config(ctx)
    config = _mode_of([base.path]) if base else None
    config = 0o644 if config is None else (config & 0o666) | 0o600
    sources = list(ctx.deployment.sources) + ([base.path] if base else [])
    script = _mode_of(sources)
    script = 0o755 if script is None else (script & 0o666) | ((script & 0o444) >> 2) | 0o700
    return config, script


def _backup(path: Path) -> Path | None:
    """Copy an existing ``path`` to ``path.bak`` (``.bak.1``, ... when taken), with its mode; the copy's path."""
    if not path.exists():
        return None
    candidate, n = path.with_name(path.name + ".bak"), 0
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}.bak.{n}")
    shutil.copy2(path, candidate, follow_symlinks=False)
    return candidate


def write_migration(ctx: Context, outdir: str | os.PathLike[str], *, force: bool = False,
                    notes: list[str] | None = None) -> list[str]:
    """Write ``mooncake_config.json`` and ``launch_v1.sh`` into ``outdir``; return their paths.

    Modes never widen the inputs' (see :func:`output_modes`) nor a file being
    replaced; with ``force`` an existing file is first copied to ``NAME.bak``
    (a line for each goes to ``notes``).
    """
    check_outdir(outdir, force=force)
    out = Path(outdir)
    config_text = json.dumps(migrated_config(ctx), indent=2) + "\n"
    script_text = migrated_script(ctx)  # build both before touching the disk
    config_mode, script_mode = output_modes(ctx)
    out.mkdir(parents=True, exist_ok=True)
    for name, text, mode in ((CONFIG_NAME, config_text, config_mode), (SCRIPT_NAME, script_text, script_mode)):
        target = out / name
        existing = _mode_of([str(target)]) if target.exists() and not target.is_symlink() else None
        if existing is not None:
            mode &= existing | (0o700 if name == SCRIPT_NAME else 0o600)
        saved = _backup(target)
        if saved is not None and notes is not None:
            notes.append(f"kept the previous {target} as {saved}")
        _atomic_write(target, text, mode)
    return [str(out / CONFIG_NAME), str(out / SCRIPT_NAME)]
