"""``mooncake-vllm pool namespaces|stats|clear``: what the pool holds per key namespace.

Source: the master's HTTP port (``GET /get_all_keys``, streamed and only counted,
cut at ``--max-keys``; ``GET /batch_query_keys`` for sizes), plus the registry
keys every instance writes at start (``mcv-ns/<digest>/<fields>``), which name each
namespace's model, dtype, layout, block size, TP size, tenant and cache_prefix.
No value is read. ``clear`` removes the values of exactly ONE engine namespace
(all its TP/PP ranks) with the Mooncake client's ``remove_by_regex``; a filter
matching several is refused, naming what differs.

The master: ``--master-http URL``, else the HTTP port of the master of
``--config`` / ``$MOONCAKE_CONFIG_PATH`` (read from its command line when it runs
on this host, else Mooncake's default 9003).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["configure", "run"]

_SOURCE = ("Source: the master's HTTP port (GET /get_all_keys, streamed, counted, cut at --max-keys; "
           "GET /batch_query_keys for sizes) and the registry keys instances write at start "
           "(mcv-ns/<digest>/<fields>). Values are never read; the master keeps no per-key time, so no age.")
_FILTERS = (("--model", "model_id", str, "model id (kv_connector_extra_config model_id, else the model dir name)"),
            ("--block-size", "block_size", int, "KV block size"),
            ("--dtype", "dtype", str, "KV dtype (e.g. float32, bfloat16, uint8 for fp8)"),
            ("--layout", "layout", str, "KV layout fingerprint (see `pool namespaces`)"),
            ("--tp-size", "tp_size", int, "tensor-parallel size"),
            ("--tenant", "tenant", str, "tenant_id (default: the config's tenant_id, else none; "
                                        "never a wildcard)"),
            ("--cache-prefix", "cache_prefix", str, "cache_prefix (default: none; never a wildcard)"))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = _SOURCE
    sub = parser.add_subparsers(dest="pool_command", metavar="ACTION")
    sub.required = True
    helps = {"namespaces": "list every namespace in the pool, with value counts and what splits a model",
             "stats": "values and bytes per namespace (--json for machines)",
             "clear": "remove the values of exactly one namespace (--dry-run: only count)"}
    for name, text in helps.items():
        sp = sub.add_parser(name, help=text, description=f"{text}. {_SOURCE}")
        sp.add_argument("--config", metavar="PATH", help="Mooncake config (default: $MOONCAKE_CONFIG_PATH)")
        sp.add_argument("--master-http", metavar="URL",
                        help="the master's HTTP address, http://HOST:METRICS_PORT (default: the master of the "
                             "config: its --metrics_port when it runs on this host, else 9003)")
        sp.add_argument("--max-keys", type=int, default=1_000_000, metavar="N",
                        help="list at most N keys (default 1000000); a cut listing is reported as truncated")
        sp.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds per HTTP call (default 5)")
        sp.add_argument("--json", action="store_true", help="print JSON")
    clear = sub.choices["clear"]
    for flag, dest, kind, text in _FILTERS:
        clear.add_argument(flag, dest=dest, type=kind, required=flag == "--model", help=text,
                           metavar=dest.split("_")[-1].upper())
    clear.add_argument("--digest", metavar="HEX", help="one exact rank namespace (16 hex digits) instead")
    clear.add_argument("--dry-run", action="store_true", help="only say what would be removed")


def _config(args: argparse.Namespace) -> Any:
    from mooncake_vllm.config import CONFIG_ENV, load_store_config

    if args.config or os.environ.get(CONFIG_ENV):
        return load_store_config(args.config)
    return None


def _master_http(args: argparse.Namespace, config: Any) -> str:
    if args.master_http:
        return str(args.master_http)
    if config is None:
        raise ValueError("no master given: pass --master-http http://HOST:METRICS_PORT, or --config / "
                         "$MOONCAKE_CONFIG_PATH naming master_server_address")
    from mooncake_vllm.checker.probe import master_http_url

    url = master_http_url(config.master_server_address)
    if url is None:
        raise ValueError(f"master_server_address {config.master_server_address!r} has no host:port (HA via etcd?); "
                         f"pass --master-http http://HOST:METRICS_PORT")
    return url


def _table(inv: Any, with_bytes: bool) -> str:
    from mooncake_vllm.inventory import splits

    lines = [f"pool at {inv.url}: {inv.listed_keys} key(s) listed"
             + (" (TRUNCATED at --max-keys: counts are lower bounds)" if inv.truncated else "")
             + f", {inv.other_keys} not mooncake-vllm's"]
    for e in inv.sorted():
        what = e.namespace.describe() if e.namespace else "(unregistered: fields unknown)"
        size = ""
        if with_bytes:
            size = "  bytes ?" if e.bytes is None else f"  bytes {'~' * e.bytes_estimated}{e.bytes}"
            if e.on_disk:  # only a pool with a disk tier has any
                size += f"  (DRAM {'~' * e.bytes_estimated}{e.in_dram}, disk {'~' * e.bytes_estimated}{e.on_disk})"
        lines.append(f"  {e.digest}  values {e.keys:>8}{size}  {what}")
    if not inv.entries:
        lines.append("  (no mooncake-vllm namespace)")
    lines += [f"  ! {s.text()}" for s in splits(inv)]
    if with_bytes:
        lines.append(_tiers_line(inv.tiers or {}))
        lines.append("  age: not exposed by mooncake_master (no per-key time on its HTTP port)")
    return "\n".join(lines) + "\n"


def _tiers_line(t: dict[str, int]) -> str:
    def used(tier: str) -> str:
        cap = t.get(f"{tier}_capacity_bytes")
        return f"{t.get(f'{tier}_used_bytes', '?')} / {cap if cap is not None else '?'} bytes"

    # the master exports its eviction counters from the first eviction on
    line = f"  DRAM {used('dram')}, {t.get('dram_evicted_values', 0)} value(s) evicted"
    if not t.get("disk_capacity_bytes"):
        return line + "; no disk tier (evicted values are gone: `mooncake-vllm up --ssd DIR`)"
    return (line + f"; disk {used('disk')}, {t.get('disk_values', '?')} value(s), "
            f"{t.get('disk_reads', '?')} read(s) answered from disk")


def _select(args: argparse.Namespace, inv: Any, config: Any) -> list[Any]:
    """The rank namespaces of the ONE engine namespace the filters name (ValueError otherwise)."""
    from mooncake_vllm.inventory import engine_fields

    registered = [e.namespace for e in inv.entries.values() if e.namespace is not None]
    if args.digest:
        chosen = [ns for ns in registered if ns.digest() == args.digest and ns.model_id == args.model_id]
        if not chosen:
            raise ValueError(f"--digest {args.digest}: no registered namespace of model {args.model_id!r} has it "
                             f"(see `mooncake-vllm pool namespaces`)")
        return chosen
    wanted = {dest: getattr(args, dest) for _, dest, _, _ in _FILTERS if getattr(args, dest) is not None}
    wanted.setdefault("tenant", config.tenant_id if config is not None else "")
    wanted.setdefault("cache_prefix", "")
    matching = [ns for ns in registered if all(getattr(ns, k) == v for k, v in wanted.items())]
    groups: dict[tuple, list[Any]] = {}
    for ns in matching:
        groups.setdefault(engine_fields(ns), []).append(ns)
    if not groups:
        raise ValueError(f"no registered namespace matches {wanted} (see `mooncake-vllm pool namespaces`)")
    if len(groups) > 1:
        keys = sorted(groups, key=_field_order)  # one order on every run: block_size 32 before 64
        differ = [name for name, _ in keys[0] if len({dict(k)[name] for k in keys}) > 1]
        values = "; ".join(f"{n}: {' vs '.join(str(dict(k)[n]) for k in keys)}" for n in differ)
        flags = ", ".join("--" + n.replace("_", "-") for n in differ)
        raise ValueError(f"{len(groups)} namespaces match ({values}); add {flags} to pick exactly one")
    return next(iter(groups.values()))


def _clear(args: argparse.Namespace, inv: Any, config: Any) -> dict[str, Any]:
    chosen = _select(args, inv, config)
    digests = {ns.digest() for ns in chosen}
    counted = sum(e.keys for d, e in inv.entries.items() if d in digests)
    out: dict[str, Any] = {"namespaces": sorted(ns.describe() for ns in chosen), "digests": sorted(digests),
                           "listed_values": counted, "dry_run": bool(args.dry_run), "removed": None}
    if args.dry_run:
        return out
    if config is None:
        raise ValueError("removing needs a Mooncake client: pass --config or set $MOONCAKE_CONFIG_PATH")
    from mooncake_vllm.store import StoreClient
    from mooncake_vllm.store.namespaces import clear_namespaces

    with StoreClient.connect(config, timeout=args.timeout) as client:
        removed = clear_namespaces(client, chosen)
    if removed is None:
        raise ValueError("the pool did not remove them (master away, or Mooncake < 0.3.6 without "
                         "remove_by_regex); nothing was changed by this command")
    out["removed"] = removed
    return out


def run(args: argparse.Namespace) -> int:
    from mooncake_vllm.errors import ConfigError, StoreUnavailableError
    from mooncake_vllm.inventory import scan_pool, splits

    try:
        config = _config(args)
        url = _master_http(args, config)
        inv = scan_pool(url, timeout=args.timeout, max_keys=args.max_keys,
                        sizes=args.pool_command == "stats")
        if args.pool_command == "clear":
            result = _clear(args, inv, config)
            if args.json:
                print(json.dumps(result, indent=2))
            else:
                verb = "would remove" if result["dry_run"] else f"removed {result['removed']} value(s) of"
                print(f"{verb} {len(result['digests'])} namespace(s), {result['listed_values']} value(s) listed:")
                print("".join(f"  {d}\n" for d in result["namespaces"]), end="")
            return 0
    except (ConfigError, StoreUnavailableError, ValueError) as exc:
        print(f"mooncake-vllm pool {args.pool_command}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        doc = inv.as_dict()
        doc["splits"] = [{"text": s.text(), "model": s.model, **dict(s.scope),
                          "differ": {n: list(v) for n, v in s.differ}} for s in splits(inv)]
        print(json.dumps(doc, indent=2))
    else:
        sys.stdout.write(_table(inv, with_bytes=args.pool_command == "stats"))
    return 0


def _field_order(fields: tuple[tuple[str, object], ...]) -> list[tuple[int, float, str]]:
    """Sort key of an engine's fields: numbers by value, the rest as text."""
    return [(0, float(v), "") if isinstance(v, (int, float)) else (1, 0.0, str(v)) for _, v in fields]
