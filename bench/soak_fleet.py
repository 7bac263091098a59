"""The soak's fleet: master, embedded metadata, holders, vLLM CPU instances and proxies, each
service on its own simulated host (``soak_net``), or all on loopback where namespaces
cannot be made. Every process is a :class:`ManagedProcess` we started (signalled by PID).

Hosts: ``master`` (mooncake_master, fixed ports so a restart comes back where clients
look), ``meta`` (our embedded metadata server, fixed port), ``h1``..``hN`` (holders),
one per vLLM instance (``v1``, ``v2`` kv_both, ``p`` kv_producer, ``d`` kv_consumer);
the reference instance (no connector) and the proxies run in the driver's namespace.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_vllm.services import (
    LOOPBACK,
    ManagedProcess,
    Placement,
    cli_argv,
    cpu_binding,
    free_port,
    start_holder,
    start_http_metadata,
    start_master,
    start_vllm_server,
)
from mooncake_vllm.services.process import http_probe
from soak_net import Net

__all__ = ["Fleet", "process_usage"]


def process_usage(pid: int) -> tuple[int, int]:
    """(RSS bytes, open file descriptors) of ``pid`` and its children in its group (Linux /proc)."""
    rss = fds = 0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rfind(")") + 2:].split()[2]) != pid:  # pgrp
                continue
            rss += int(Path(f"/proc/{entry}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            fds += len(os.listdir(f"/proc/{entry}/fd"))
        except (OSError, ValueError):
            continue
    return rss, fds


@dataclass
class Fleet:
    """Start, signal and restart the soak's services by role name."""

    workdir: Path
    net: Net | None  #: None: everything on loopback
    holders: int = 2
    segment_size: int = 128 << 20  #: each holder's
    client_ttl: int = 5
    #: each vLLM instance's KV cache: smaller than the documents, or its own prefix cache
    #: answers every repeat and the pool is never asked
    kv_cache_bytes: int = 8 << 20
    #: our connector's ``load_policy`` (``kv_connector_extra_config``)
    load_policy: str = "auto"
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    places: dict[str, Placement] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    config_path: Path | None = None
    models: dict[str, tuple[Path, str | None]] = field(default_factory=dict)  #: vLLM role -> (model, kv_role)
    flooding: bool = False  #: read by the load: send unique documents (the ``flood`` fault)
    admin_key: str = "soak"

    def place(self, name: str) -> Placement:
        if name not in self.places:
            self.places[name] = self.net.add_host(name) if self.net is not None else LOOPBACK
        return self.places[name]

    # ------------------------------------------------------------------ the pool
    def start_pool(self) -> Path:
        """Master, metadata and holders; writes the clients' mooncake_config.json."""
        self.ports.update(master=free_port(), master_metrics=free_port(), meta=free_port())
        self.start("master")
        self.start("meta")
        for i in range(1, self.holders + 1):
            self.start(f"h{i}")
        cfg = {"metadata_server": self.procs["meta"].url, "global_segment_size": "0",
               "master_server_address": self.procs["master"].address,
               "local_buffer_size": str(64 << 20), "protocol": "tcp", "device_name": ""}
        self.config_path = self.workdir / "mooncake_config.json"
        self.config_path.write_text(json.dumps(cfg, indent=2))
        return self.config_path

    def start(self, name: str, **kw: Any) -> ManagedProcess:
        """(Re)start role ``name`` on its host, on the ports it had (master, metadata)."""
        if name not in ("master", "meta") and not name.startswith("h"):
            proc = self.start_vllm(name, **kw)
            self.procs[name] = proc
            return proc
        where = self.place(name)
        if name == "master":
            proc = start_master(self.workdir, self.client_ttl, port=self.ports["master"],
                                metrics_port=self.ports["master_metrics"], placement=where)
        elif name == "meta":
            proc = start_http_metadata(self.workdir, "embedded", port=self.ports["meta"], placement=where)
        else:
            proc = start_holder(self.workdir, str(self.procs["master"].address),
                                str(self.procs["meta"].url), self.segment_size, 32 << 20,
                                name=f"holder-{name}", placement=where)
        self.procs[name] = proc
        return proc

    # ------------------------------------------------------------------ vLLM and proxies
    def start_vllm(self, name: str, model: Path | None = None, role: str | None = None,
                   **_: Any) -> ManagedProcess:
        """A vLLM CPU server; ``role`` None: no connector (the reference), on loopback.
        A restart (no ``model``) takes the model and role it started with."""
        from mooncake_vllm.demo.run import kv_transfer_config

        if model is None:
            model, role = self.models[name]
        self.models[name] = (model, role)
        where = self.place(name) if role is not None else LOOPBACK
        env = {"MOONCAKE_CONFIG_PATH": str(self.config_path)} if role is not None else {}
        env.update(cpu_binding(list(self.models).index(name)))  # first-start order: kept across restarts
        port = self.ports.setdefault(name, free_port())
        config = kv_transfer_config(role, extra={"load_policy": self.load_policy}) if role else None
        return start_vllm_server(model, port, self.workdir, config,
                                 env, name=name, timeout=1800, placement=where,
                                 kv_cache_bytes=self.kv_cache_bytes)

    def start_proxy(self, name: str, model: str, flow: str, prefill: list[str], decode: list[str],
                    ) -> ManagedProcess:
        """``mooncake-vllm proxy`` on loopback over instances (role names) of this fleet."""
        port = self.ports.setdefault(name, free_port())
        argv = [*cli_argv("proxy"), "--model", model, "--port", str(port), "--flow", flow,
                "--health-interval", "1", "--health-failures", "2", "--drain-timeout", "60"]
        for flag, names in (("--prefill", prefill), ("--decode", decode)):
            if names:
                argv += [flag, *(str(self.procs[n].address) for n in names)]
        env = {**os.environ, "ADMIN_API_KEY": self.admin_key}
        proc = ManagedProcess(name, argv, workdir=self.workdir, env=env, port=port).start()
        proc.address, proc.url = f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"
        proc.wait_ready(http_probe(f"{proc.url}/health", lambda s, b: s == 200), 120, "serving")
        self.procs[name] = proc
        return proc

    # ------------------------------------------------------------------ faults
    def link(self, name: str, up: bool) -> None:
        """Cut (``up`` False) or restore ``name``'s link (on loopback: SIGSTOP/SIGCONT instead)."""
        if self.net is None:
            (self.resume if up else self.pause)(name)
        elif up:
            self.net.link_up(name)
        else:
            self.net.link_down(name)

    def flood(self, on: bool) -> None:
        self.flooding = on

    def rolling_restart(self, proxy: str = "proxy", names: tuple[str, ...] = ("v1", "v2")) -> None:
        """Through ``proxy``'s admin API, one instance at a time: remove (drains its requests),
        restart, add back (the proxy checks it serves the model first)."""
        for name in names:
            body = {"type": "decode", "instance": str(self.procs[name].address)}
            self._admin(proxy, "remove", body)
            self.restart(name)
            self._admin(proxy, "add", body)

    def _admin(self, proxy: str, op: str, body: dict[str, str]) -> dict[str, Any]:
        import urllib.request

        req = urllib.request.Request(f"{self.procs[proxy].url}/instances/{op}", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"X-API-Key": self.admin_key, "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 - our proxy
            return dict(json.loads(resp.read()))

    def kill(self, name: str) -> None:
        self.procs[name].kill()

    def pause(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGCONT)

    def restart(self, name: str) -> ManagedProcess:
        old = self.procs.get(name)
        if old is not None:
            old.stop(grace=5.0)
        return self.start(name)

    def usage(self) -> dict[str, tuple[int, int, int]]:
        """(RSS, fds, pid) of every live service, by role (the pid tells restarts apart)."""
        return {name: (*process_usage(p.pid), p.pid) for name, p in self.procs.items() if p.alive()}

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a paused process cannot handle SIGTERM
            except (ProcessLookupError, Exception):  # noqa: BLE001 - not started / gone
                pass
            proc.stop(grace=5.0)
        self.procs.clear()

    def wait_alive(self, name: str, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].alive():
                return True
            time.sleep(0.2)
        return False
