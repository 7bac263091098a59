"""What the engine tests read back from one ``mooncake_vllm.demo.run`` instance."""

from __future__ import annotations

import random
import re
from typing import Any

from mooncake_vllm.keys import KeyNamespace

__all__ = ["announced_namespace", "hits", "prompt", "tokens"]

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
    """vLLM's own external-hit counter (missing = broken metrics, never "0 hits")."""
    return result["metrics"]["vllm:external_prefix_cache_hits"]


def tokens(result: dict[str, Any]) -> list[list[int]]:
    """The greedy output tokens of every prompt."""
    return [r["tokens"] for r in result["results"]]
