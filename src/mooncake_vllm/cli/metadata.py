"""``mooncake-vllm metadata list|gc|serve``: inspect, clean and serve Transfer Engine metadata.

The metadata URL comes from ``--metadata``, else from the ``metadata_server``
of ``$MOONCAKE_CONFIG_PATH``, else from ``$MOONCAKE_TE_META_DATA_SERVER``.
``gc`` is a dry run unless ``--apply`` is given; with ``--apply`` a segment is
deleted only after it refused connections throughout ``--grace`` seconds and once
more right before the delete (a timeout never counts as dead), and never while
the master (``--master``) lists it as mounted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="metadata_command", metavar="ACTION")
    sub.required = True
    for name, help_text in (("list", "show Transfer Engine metadata entries"),
                            ("gc", "find (and with --apply remove) entries whose owner is gone")):
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.add_argument("--metadata", metavar="URL",
                        help="http://h:p/metadata, etcd://h:p, h:p (etcd) or redis://h:p "
                             "(default: metadata_server of $MOONCAKE_CONFIG_PATH)")
        sp.add_argument("--prefix", default="mooncake/", help="only keys under this prefix (default mooncake/)")
        sp.add_argument("--format", choices=("table", "json"), default="table", help="output format")
        sp.add_argument("--timeout", type=float, default=1.0, metavar="S",
                        help="seconds to wait for each owner's TCP port (default 1.0)")
    gc_parser = sub.choices["gc"]
    gc_parser.add_argument("--apply", action="store_true", help="really delete stale entries (default: dry run)")
    gc_parser.add_argument("--master", metavar="URL", default=None,
                           help="mooncake_master's HTTP address (http://HOST:METRICS_PORT, default port 9003): "
                                "segments it lists as mounted are alive; asked first, and before each delete")
    gc_parser.add_argument("--grace", type=float, default=None, metavar="S",
                           help="with --apply: a segment must stay dead (connection refused) over S seconds, "
                                "probed several times, before its entries are deleted (default 10, Mooncake's "
                                "client_ttl); a timeout never counts as dead")
    serve = sub.add_parser("serve", help="run the HTTP metadata server (Mooncake's protocol)",
                           description="run the HTTP metadata server (Mooncake's protocol) in the foreground")
    from mooncake_vllm.metadata.server import add_arguments

    add_arguments(serve)


def _metadata_url(args: argparse.Namespace) -> str | None:
    if args.metadata:
        return str(args.metadata)
    from mooncake_vllm.config import CONFIG_ENV, load_store_config

    if os.environ.get(CONFIG_ENV):
        return load_store_config().metadata_server
    return os.environ.get("MOONCAKE_TE_META_DATA_SERVER") or None


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _owner(value: bytes | None) -> str:
    from mooncake_vllm.metadata.entries import rpc_address

    if value is None:
        return "-"
    addr = rpc_address(value)
    if addr:
        return f"rpc {addr[0]}:{addr[1]}"
    try:
        doc = json.loads(value)
        return f"tcp {doc.get('tcp_data_host', '?')}:{doc['tcp_data_port']}" if "tcp_data_port" in doc else "-"
    except (ValueError, TypeError, KeyError, AttributeError):
        return "-"


def _list(backend: Any, args: argparse.Namespace) -> int:
    rows = []
    for key in backend.list(args.prefix):
        value = backend.get(key)
        rows.append({"key": key, "bytes": None if value is None else len(value), "owner": _owner(value)})
    if args.format == "json":
        print(json.dumps({"backend": backend.url, "entries": rows}, indent=2))
    else:
        print(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'} in {backend.url}")
        if rows:
            print(_table(["KEY", "BYTES", "OWNER"], [[r["key"], r["bytes"], r["owner"]] for r in rows]))
    return 0


def _gc(backend: Any, args: argparse.Namespace) -> int:
    from mooncake_vllm.metadata.gc import DEFAULT_GRACE, collect_garbage

    grace = DEFAULT_GRACE if args.grace is None else max(0.0, args.grace)
    report = collect_garbage(backend, apply=args.apply, timeout=args.timeout, prefix=args.prefix,
                             master=args.master, grace=grace)
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=2))
        return 1 if report.errors else 0
    stale_keys = [k for s in report.stale for k in s.keys]
    print(f"{len(report.segments)} segment(s) in {report.backend}; {len(report.stale)} stale "
          f"({len(stale_keys)} entr{'y' if len(stale_keys) == 1 else 'ies'})")
    if report.segments:
        print(_table(["SEGMENT", "STATE", "KEYS", "PROBE"],
                     [[s.segment, s.state, len(s.keys), s.reason] for s in report.segments]))
    if report.applied:
        for key in report.deleted:
            print(f"deleted {key}")
        for key in report.kept:
            print(f"kept {key} ({report.kept_why.get(key, 'changed since the probe')})")
        for err in report.errors:
            print(f"error: {err}", file=sys.stderr)
        print(f"deleted {len(report.deleted)} entr{'y' if len(report.deleted) == 1 else 'ies'}")
    elif stale_keys:
        print("dry run: nothing deleted; re-run with --apply to delete:")
        for key in stale_keys:
            print(f"  {key}")
    return 1 if report.errors else 0


def run(args: argparse.Namespace) -> int:
    from mooncake_vllm.errors import ConfigError, StoreError, StoreUnavailableError

    if args.metadata_command == "serve":
        from mooncake_vllm.metadata import server

        backend = args.backend or os.environ.get(server.BACKEND_ENV) or "memory"
        return server.serve(backend, host=args.host, port=args.port, path=args.path,
                            exit_with_parent=args.exit_with_parent)
    try:
        url = _metadata_url(args)
        if not url:
            print("error: --metadata: no metadata server given and $MOONCAKE_CONFIG_PATH is not set; pass "
                  "--metadata http://host:port/metadata (or etcd://host:port, redis://host:port)", file=sys.stderr)
            return 2
        from mooncake_vllm.metadata.backends import backend_for

        with backend_for(url) as backend:
            return _list(backend, args) if args.metadata_command == "list" else _gc(backend, args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (StoreUnavailableError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
