"""``mooncake-vllm holder``: a process that mounts pool memory and keeps it until SIGTERM.

vLLM instances in the seed's V1 shape are pure clients (``global_segment_size
"0"``); the pool's memory must live in another process. Mooncake ≥ 0.3.8 ships
``mooncake_client`` for that; this command does the same with an ordinary store
client and therefore also works with older wheels and every metadata backend
the store client supports (including ``redis://`` through the bridge).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a mooncake.json / mooncake_config.json to take addresses from "
                        "(default: $MOONCAKE_CONFIG_PATH when --master is not given)")
    parser.add_argument("--master", help="master_server_address, e.g. 127.0.0.1:50051")
    parser.add_argument("--metadata", help='metadata_server, e.g. "http://127.0.0.1:8080/metadata" '
                        'or "P2PHANDSHAKE"')
    parser.add_argument("--segment-size", default="1GB", help="pool memory to hold (default 1GB)")
    parser.add_argument("--local-buffer", default="64MB", help="staging buffer (default 64MB)")
    parser.add_argument("--host", default="127.0.0.1", help="address peers use to reach this holder")
    parser.add_argument("--ready-port", type=int, default=None,
                        help="listen on 127.0.0.1:PORT once the segment is mounted (a readiness probe)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the master")
    parser.add_argument("--ssd", metavar="DIR", help="offload this holder's memory to a disk tier in DIR (the master "
                        "needs --enable_offload=true; Mooncake >= 0.3.11); default: the config's ssd_offload_path "
                        "when it sets enable_ssd_offload")
    parser.add_argument("--ssd-size", default="64GB", help="disk the tier may fill (default 64GB)")


def _settings(args: argparse.Namespace) -> dict[str, object]:
    from mooncake_vllm.config import CONFIG_ENV, load_store_config, read_config_data

    data: dict[str, object] = {}
    path = args.config or (None if args.master else os.environ.get(CONFIG_ENV))
    if path:
        raw, _label = read_config_data(path)
        # the addresses, and the disk tier (a holder is where it means something): sizes are ours
        base = load_store_config({k: v for k, v in raw.items() if k != "ssd_offload_path"})
        data = {"metadata_server": base.metadata_server, "master_server_address": base.master_server_address,
                "protocol": base.protocol, "device_name": base.device_name}
        if base.ssd_offload and raw.get("ssd_offload_path"):
            data.update(enable_ssd_offload=True, ssd_offload_path=raw["ssd_offload_path"])
    if args.ssd:
        data.update(enable_ssd_offload=True, ssd_offload_path=os.path.abspath(args.ssd))
    if args.master:
        data["master_server_address"] = args.master
    if args.metadata:
        data["metadata_server"] = args.metadata
    data.setdefault("protocol", "tcp")
    data.update(local_hostname=args.host, global_segment_size=args.segment_size,
                local_buffer_size=args.local_buffer)
    return data


def run(args: argparse.Namespace) -> int:
    from mooncake_vllm.config import load_store_config
    from mooncake_vllm.errors import ConfigError, StoreUnavailableError
    from mooncake_vllm.store import StoreClient

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        config = load_store_config(_settings(args))
    except (ConfigError, ValueError) as exc:
        print(f"mooncake-vllm holder: {exc}", file=sys.stderr)
        return 2
    if config.ssd_offload:
        from mooncake_vllm.config import parse_size
        from mooncake_vllm.services.tier import holder_env

        try:
            share = parse_size(args.ssd_size, field="--ssd-size")
        except ValueError as exc:
            print(f"mooncake-vllm holder: {exc}", file=sys.stderr)
            return 2
        os.makedirs(config.ssd_offload_path, exist_ok=True)
        os.environ.update(holder_env(config.ssd_offload_path, share))
    if config.global_segment_size <= 0:
        print("mooncake-vllm holder: --segment-size must be > 0 (it is the pool memory this process "
              f"holds), found {args.segment_size!r}", file=sys.stderr)
        return 2
    try:
        client = StoreClient.connect(config, timeout=args.timeout)
    except StoreUnavailableError as exc:
        print(f"mooncake-vllm holder: {exc}", file=sys.stderr)
        return 1
    ready = None
    try:
        if args.ready_port:
            ready = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            ready.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ready.bind(("127.0.0.1", args.ready_port))
            ready.listen(16)
        tier = f", disk tier {config.ssd_offload_path}" if config.ssd_offload else ""
        print(f"holder ready: {config.global_segment_size} bytes mounted{tier} at master "
              f"{config.master_server_address} (metadata {config.metadata_server}), pid {os.getpid()}",
              flush=True)
        while not stop.wait(0.5):
            if ready is not None:  # accept and drop probe connections
                ready.settimeout(0)
                try:
                    conn, _ = ready.accept()
                    conn.close()
                except OSError:
                    pass
    finally:
        t0 = time.monotonic()
        client.close()
        if ready is not None:
            ready.close()
        print(f"holder stopped (close took {time.monotonic() - t0:.1f} s)", flush=True)
    return 0
