"""What the engine tests read back from one ``mooncake_vllm.demo.run`` instance."""

from __future__ import annotations

import json
import random
import re
import urllib.request
from typing import Any

from mooncake_vllm.compat import installed_facts
from mooncake_vllm.keys import KeyNamespace

__all__ = ["SERVE_HIT_ARGS", "announced_namespace", "complete", "counts_connector_hits", "external_hits",
           "hits", "loads_here", "prompt", "tokens", "upsert_raw"]

ANNOUNCE = re.compile(r"mooncake-vllm \S+: MooncakeStoreConnector on the vLLM V1 engine .* "
                      r"role (\w+), .*namespace (\S+)")


def prompt(seed: int, n: int) -> list[int]:
    """``n`` reproducible random token ids."""
    rnd = random.Random(seed)
    return [rnd.randrange(10, 2000) for _ in range(n)]


def announced_namespace(log: str) -> KeyNamespace:
    """The namespace an instance announced in its one INFO line."""
    m = ANNOUNCE.search(log)
    assert m, "the connector's INFO line is missing:\n" + log[-3000:]
    return KeyNamespace.parse(m.group(2))


def hits(result: dict[str, Any]) -> float:
    """vLLM's own external-hit counter (missing = broken metrics, never "0 hits").

    vLLM <= 0.11.0 has no such counter: there, vLLM's own per-request count of prefix
    tokens it did not compute (``num_cached_tokens`` of each prompt's first request), which
    in a fresh instance serving distinct prompts is exactly what the pool served."""
    if counts_connector_hits():
        return result["metrics"]["vllm:external_prefix_cache_hits"]
    cached = [r["cached_tokens"] for r in result["results"]]
    assert None not in cached, "vLLM reported no num_cached_tokens: 0 hits would be vacuous"
    return float(sum(cached))


def tokens(result: dict[str, Any]) -> list[list[int]]:
    """The greedy output tokens of every prompt."""
    return [r["tokens"] for r in result["results"]]


def complete(url: str, prompt: list[int]) -> dict:
    """One greedy 8-token completion of ``prompt`` (token ids) from a vLLM server."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def fact(name: str) -> bool:
    """A boolean fact of the installed vLLM (True without one: the newest behaviour)."""
    facts = installed_facts()
    return facts is None or bool(getattr(facts, name))


def vllm_source_contains(relpath: str, text: str) -> bool:
    """Whether the installed vLLM's file ``relpath`` (inside the package) contains ``text``,
    read without importing vLLM (for what no fact of the connector's covers: test set-up)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = Path(next(iter(spec.submodule_search_locations))) / relpath
    return path.is_file() and text in path.read_text(errors="replace")


def example_connector() -> str:
    """vLLM's example (shared-storage) connector's registry name: ``ExampleConnector``, or
    ``SharedStorageConnector`` on releases before the rename (0.9.2, 0.10.0)."""
    factory = "distributed/kv_transfer/kv_connector/factory.py"
    return "ExampleConnector" if vllm_source_contains(factory, '"ExampleConnector"') else "SharedStorageConnector"


def loads_here() -> bool:
    """Whether our connector loads on this vLLM: only where vLLM recomputes a block whose
    load fails (0.11.1+); before, it saves and never loads (a failed load would be wrong KV)."""
    return fact("load_error_reporting")


def counts_connector_hits() -> bool:
    """Whether this vLLM counts a connector's hits itself (0.11.1+, see ``hits``)."""
    return fact("external_hit_counter")


#: what a ``vllm serve`` needs for :func:`external_hits` to read its count from a response
#: where vLLM has no connector hit counter (``usage.prompt_tokens_details.cached_tokens``)
SERVE_HIT_ARGS: tuple[str, ...] = () if counts_connector_hits() else ("--enable-prompt-tokens-details",)


def external_hits(url: str, response: dict | None = None) -> float:
    """vLLM's own external (connector) prefix-cache hit tokens, from ``/metrics``; where vLLM
    has no such counter (<= 0.11.0), the cached prompt tokens it reported for ``response``
    (a server started with :data:`SERVE_HIT_ARGS`, fresh, serving distinct prompts)."""
    if not counts_connector_hits():
        assert response is not None, "this vLLM has no connector hit counter: pass the response"
        # vLLM <= 0.11.0 fills it only when some tokens were cached (0.9.x: chat only), and
        # loads nothing there anyway (test_connector checks that through the connector's log)
        details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
        return float(details.get("cached_tokens") or 0)
    values = metric_values(url, "vllm:external_prefix_cache_hits_total")
    assert values, "the server exports no vllm:external_prefix_cache_hits_total: 0 hits would be vacuous"
    return sum(values)


def metric_values(url: str, name: str) -> list[float]:
    """The values of every series of ``name`` (a sample name's beginning) in a vLLM server's
    ``/metrics``, one per label set."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]


def upsert_raw(stack: Any, values: dict[str, bytes]) -> None:
    """Write ``values`` into the stack's pool with a plain Mooncake client (planted, damaged or
    foreign values, under whatever keys a test names)."""
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", stack.metadata_url, 0, 16 << 20, "tcp", "",
                     stack.master_address) == 0
    try:
        for key, value in values.items():
            assert raw.upsert(key, value) == 0, key
    finally:
        raw.close()
