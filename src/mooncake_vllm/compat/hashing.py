"""Whether vLLM's OWN block hashes agree between processes, per release.

Only matters where vLLM's block hashes name stored data (e.g. sharing a pool
with vLLM's in-tree connector); mooncake-vllm's keys (:mod:`mooncake_vllm.keys`)
never depend on them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from mooncake_vllm.compat.versions import vllm_facts
from mooncake_vllm.errors import UnsafeHashingError

__all__ = ["check_vllm_hash_determinism"]

_SEED_FIX = ("set PYTHONHASHSEED=0 in every instance's environment before it starts "
             "(setting it inside a running process is too late)")


def check_vllm_hash_determinism(
    vllm_version: str, hash_algorithm: str | None = None, env: Mapping[str, str] | None = None
) -> None:
    """Refuse setups whose vLLM block hashes differ between processes.

    Only matters where vLLM's OWN block hashes name stored data (e.g. sharing a
    pool with vLLM's in-tree connector); mooncake-vllm's keys never depend on them.
    Raises :class:`UnsafeHashingError` with the exact fix.
    """
    env = os.environ if env is None else env
    facts = vllm_facts(vllm_version)
    algo = hash_algorithm or facts.default_hash_algorithm
    seed = env.get("PYTHONHASHSEED")
    seeded = seed is not None and seed != "random"
    where = f"vLLM {facts.version} with --prefix-caching-hash-algo {algo}"
    if algo == "builtin" and sys.version_info < (3, 12):
        raise UnsafeHashingError(
            f"{where}: builtin hash(None) depends on object addresses on CPython "
            f"{sys.version_info.major}.{sys.version_info.minor}, so hashes differ between "
            f"processes even with PYTHONHASHSEED; start vLLM with --prefix-caching-hash-algo sha256")
    mode = facts.v1_hash_seed
    if mode == "unstable":
        raise UnsafeHashingError(f"{where}: block hashes are per-process in this release; "
                                 f"upgrade vLLM (0.10.2+ hashes with sha256) or use "
                                 f"mooncake-vllm's own keys")
    if mode == "inverted" and seed is not None:
        raise UnsafeHashingError(
            f"{where}: this release draws a random root hash exactly when PYTHONHASHSEED IS "
            f"set (found PYTHONHASHSEED={seed!r}); unset it in every instance's environment")
    needs_seed = mode == "seed-required" or (mode == "deterministic" and algo.startswith("xxhash"))
    if needs_seed and not seeded:
        found = "unset" if seed is None else f"PYTHONHASHSEED={seed!r}"
        raise UnsafeHashingError(f"{where}: block hashes differ per process unless every "
                                 f"instance shares one PYTHONHASHSEED ({found}); {_SEED_FIX}")
