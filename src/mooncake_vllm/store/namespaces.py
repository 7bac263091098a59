"""Namespaces in the pool: announce them at start, remove their values on a reset.

* :func:`register_namespaces` puts a tiny value under each namespace's
  :meth:`~mooncake_vllm.keys.KeyNamespace.registry_key` (first writer wins, so
  its value keeps the first registration time). The key itself carries the
  namespace's fields: a listing of the pool's keys (``mooncake-vllm pool``) names
  every namespace and why two of them never share blocks, without reading values.
* :func:`clear_namespaces` removes every value of the given namespaces (one
  ``remove_by_regex`` per namespace on the master, leases ignored) and leaves
  every other namespace, tenant and model alone. Readers verify each value's
  header (its key digest and checksum), so a value removed while it was read is a
  miss, never wrong KV.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence

from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.store.client import StoreClient

__all__ = ["clear_namespaces", "register_namespaces"]

log = logging.getLogger(__name__)


def _register(client: StoreClient, namespaces: Sequence[KeyNamespace]) -> int:
    stamp = json.dumps({"registered_at": round(time.time(), 3)}).encode()
    done = sum(1 for ns in namespaces if client.put_value(ns.registry_key(), stamp))
    if done < len(namespaces):
        log.warning("mooncake-vllm: %d of %d namespace registration(s) did not reach the pool; "
                    "`mooncake-vllm pool namespaces` lists their values as unregistered",
                    len(namespaces) - done, len(namespaces))
    return done


def register_namespaces(client: StoreClient, namespaces: Sequence[KeyNamespace], *,
                        background: bool = False) -> int | None:
    """Announce ``namespaces`` in the pool; the count written, or ``None`` when
    ``background`` (then a daemon thread writes them, off the caller's path)."""
    if not background:
        return _register(client, namespaces)
    threading.Thread(target=_register, args=(client, list(namespaces)), daemon=True,
                     name="mcv-register").start()
    return None


def clear_namespaces(client: StoreClient | None, namespaces: Sequence[KeyNamespace]) -> int | None:
    """Remove every value of ``namespaces``; the count removed, or ``None`` (logged) when
    the pool cannot do it now. Registry entries stay: the namespace still exists."""
    if client is None:
        log.warning("mooncake-vllm: cannot clear the pool's namespace: not connected to the "
                    "Mooncake pool; retry, or run `mooncake-vllm pool clear`")
        return None
    removed = 0
    for ns in namespaces:
        n = client.remove_matching(ns.pattern())
        if n is None:
            log.warning("mooncake-vllm: clearing namespace %s failed (pool away, or Mooncake "
                        "without remove_by_regex, < 0.3.6); its values stay in the pool. Fix: "
                        "retry once the pool answers, or `mooncake-vllm pool clear`", ns.digest())
            return None
        removed += n
    log.info("mooncake-vllm: removed %d value(s) of %d namespace(s) from the pool (%s)",
             removed, len(namespaces), ", ".join(ns.digest() for ns in namespaces))
    return removed
