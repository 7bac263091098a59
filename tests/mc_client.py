"""A real Mooncake store client in its own process, driven by JSON lines on stdin.

Usage: ``python mc_client.py --metadata URL --master H:P [--segment-mb N] [--resolve]``.
Prints ``{"ready": true, "hostname": ..., "metadata": ...}`` after ``setup`` (or
``{"ready": false, "rc": ...}``), then answers one JSON line per command:

* ``{"op": "put", "prefix": P, "n": N}`` → ``{"ok": count}`` (values pinned to this client's segment)
* ``{"op": "get", "prefix": P, "n": N}`` → ``{"ok": count}`` (count of byte-exact values)
* ``{"op": "quit"}`` → closes the store and exits.

``--resolve`` routes the URL through ``resolve_metadata_url`` first (the redis bridge).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys


def value_for(key: str, size: int = 4096) -> bytes:
    digest = hashlib.sha256(key.encode()).digest()
    return (digest * (size // len(digest) + 1))[:size]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--metadata", required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--segment-mb", type=int, default=0)
    parser.add_argument("--resolve", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")

    url, cleanup = args.metadata, None
    if args.resolve:
        from mooncake_vllm.store.bridge import mooncake_supports_redis, resolve_metadata_url

        url, cleanup = resolve_metadata_url(url, supports_redis=mooncake_supports_redis())

    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", url, args.segment_mb << 20, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        print(json.dumps({"ready": False, "rc": rc}), flush=True)
        return 1
    hostname = store.get_hostname()
    print(json.dumps({"ready": True, "hostname": hostname, "metadata": url}), flush=True)
    config = ReplicateConfig()
    if args.segment_mb:
        config.preferred_segment = hostname
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        keys = [f"{cmd['prefix']}/{i}" for i in range(cmd["n"])]
        if cmd["op"] == "put":
            ok = sum(store.put(k, value_for(k), config) == 0 for k in keys)
        else:
            ok = sum(store.get(k) == value_for(k) for k in keys)
        print(json.dumps({"ok": ok}), flush=True)
    store.close()
    if cleanup is not None:
        cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
