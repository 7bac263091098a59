"""``mooncake-vllm proxy``: the XpYd prefill/decode proxy, seed-compatible flags.

``ADMIN_API_KEY`` (environment) enables ``/instances/add`` and ``/instances/remove``;
``OPENAI_API_KEY`` is sent upstream when a client sends no ``Authorization``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

__all__ = ["configure", "join_bootstrap_ports", "run"]


def join_bootstrap_ports(items: list[str]) -> list[str]:
    """Accept vLLM's P2P proxy form ``--prefill URL [BOOTSTRAP_PORT|none]``: a bare port
    (or ``none``) after an address becomes its ``@port`` suffix."""
    out: list[str] = []
    for item in items:
        if out and "@" not in out[-1] and (item.isdigit() or item.lower() == "none"):
            if item.isdigit():
                out[-1] = f"{out[-1]}@{item}"
            continue
        out.append(item)
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the proxy's flags (the seed's ``--model/-p/-d/--port/--scheduling`` plus ours)."""
    from mooncake_vllm.proxy.scheduling import POLICIES

    parser.add_argument("--model", "-m", required=True, help="model every instance must serve (basename match)")
    parser.add_argument("--prefill", "-p", nargs="+", action="extend", default=[], metavar="HOST:PORT",
                        help="prefill instances: host:port, [ipv6]:port or dns:port (http:// optional); "
                             "P2P bootstrap port as host:port@8998 or 'host:port 8998'")
    parser.add_argument("--decode", "-d", nargs="+", action="extend", default=[], metavar="HOST:PORT",
                        help="decode instances")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--scheduling", choices=sorted(POLICIES), default="round_robin",
                        help="instance selection policy (default round_robin)")
    parser.add_argument("--flow", choices=("store", "p2p", "kv_both"), default="store",
                        help="store: KV through the Mooncake pool (MooncakeStoreConnector; the "
                             "decode waits for the blocks the prefill names, bounded by the "
                             "connectors' handoff_timeout); "
                             "p2p: vLLM V1 MultiConnector(MooncakeConnector + MooncakeStoreConnector); "
                             "kv_both: no prefill step, each request to one kv_both instance (--decode)")
    parser.add_argument("--kv-events", default="tcp://127.0.0.1:5557", metavar="tcp://HOST:PORT|auto",
                        help="kv_aware: the proxy binds a ZMQ SUB socket here (auto: a free loopback port, "
                             "logged at start and in /status; for several proxies on one host); "
                             "start each instance with "
                             "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                             "\"endpoint\": \"<this>\", \"topic\": \"<its host:port>\"}' and "
                             "--enable-prompt-tokens-details (for the hit counters)")
    parser.add_argument("--unavailable-wait", type=float, default=5.0, metavar="SECONDS",
                        help="a request that finds no healthy instance of a kind waits this long for one "
                             "to come back before the 503 (default 5; 0: answer at once)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="kv_aware: the served model's directory (its tokenizer files); completion "
                             "prompts are then tokenized here instead of by a round trip to an "
                             "instance's /tokenize (chat requests still ask an instance)")
    parser.add_argument("--kv-replay", action="append", default=[], metavar="HOST:PORT=tcp://HOST:PORT",
                        help="kv_aware: an instance's replay socket (\"replay_endpoint\" in its "
                             "--kv-events-config, bound by vLLM); the proxy fetches from it what the live "
                             "stream lost (its first batches, gaps). Repeat per instance")
    parser.add_argument("--kv-queue-cap", type=int, default=0, metavar="N",
                        help="kv_aware: an instance with N requests (ours in flight and, from its /metrics, "
                             "other clients') takes no more while another has room, except the next turn of "
                             "a session it holds; 0 = no cap (default)")
    parser.add_argument("--engine-metrics-interval", type=float, default=1.0, metavar="SECONDS",
                        help="read each instance's /metrics this often: its load (requests running and "
                             "waiting, other clients' too; kv_aware weighs them) and its cache counters, "
                             "repeated in the proxy's /metrics; 0 = never (default 1)")
    parser.add_argument("--target-vllm", metavar="X.Y.Z", default=None,
                        help="vLLM version of the instances for --flow p2p (default: ask GET /version)")
    parser.add_argument("--health-interval", type=float, default=5.0, help="seconds between health checks")
    parser.add_argument("--health-failures", type=int, default=2,
                        help="consecutive failed health checks before an instance leaves rotation (default 2)")
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="seconds /instances/remove and shutdown (SIGTERM) wait for requests in flight")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="upper bound on one upstream request, seconds (default: none)")
    parser.add_argument("--max-body-mb", type=int, default=64,
                        help="largest client request body in MiB; larger ones get 413 (default 64)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


async def _serve(server) -> None:  # noqa: ANN001 - ProxyServer, imported lazily
    """Serve until SIGTERM/SIGINT, then stop listening and let requests in flight finish."""
    import signal

    log = logging.getLogger(__name__)
    port = await server.start()
    cfg = server.config
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    log.info("proxy for %s on http://%s:%d (%d prefill, %d decode, flow=%s, scheduling=%s, admin API %s)",
             cfg.model, host, port, len(cfg.prefill), len(cfg.decode), cfg.flow, cfg.scheduling,
             "enabled" if cfg.admin_api_key else "disabled")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: no new connections, waiting up to %.0f s for requests in flight", cfg.drain_timeout)
    await server.stop()


def run(args: argparse.Namespace) -> int:
    """Build the proxy from the flags and serve until interrupted."""
    import sys

    from mooncake_vllm.errors import ConfigError, UnsupportedVersionError
    from mooncake_vllm.proxy.server import ProxyServer, config_from_env

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = ProxyServer(config_from_env(
            model=args.model, prefill=join_bootstrap_ports(args.prefill), decode=args.decode,
            host=args.host, port=args.port,
            scheduling=args.scheduling, flow=args.flow, target_vllm=args.target_vllm,
            health_interval=args.health_interval, health_failures=args.health_failures,
            drain_timeout=args.drain_timeout, request_timeout=args.request_timeout,
            max_body_bytes=args.max_body_mb << 20, kv_events=args.kv_events,
            kv_replay=args.kv_replay, engine_metrics_interval=args.engine_metrics_interval,
            kv_queue_cap=args.kv_queue_cap,
            tokenizer=args.tokenizer, unavailable_wait=args.unavailable_wait))
    except (ConfigError, UnsupportedVersionError) as exc:
        print(f"mooncake-vllm proxy: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop  # optional: faster event loop when installed

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(_serve(server))
    return 0
