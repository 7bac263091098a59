"""The guard for setups whose vLLM block hashes would differ between processes."""

from __future__ import annotations

import pytest

from mooncake_vllm.compat.hashing import check_vllm_hash_determinism
from mooncake_vllm.errors import UnsafeHashingError


@pytest.mark.parametrize(("version", "algo", "env", "problem"), [
    ("0.32.0", None, {}, None),  # 0.29+: sha256 deterministic without a seed
    ("0.32.0", "xxhash", {}, "PYTHONHASHSEED=0"),
    ("0.32.0", "xxhash", {"PYTHONHASHSEED": "0"}, None),
    ("0.20.0", None, {}, "PYTHONHASHSEED=0"),
    ("0.20.0", None, {"PYTHONHASHSEED": "random"}, "PYTHONHASHSEED='random'"),
    ("0.20.0", "sha256", {"PYTHONHASHSEED": "7"}, None),
    ("0.8.3", "sha256", {"PYTHONHASHSEED": "0"}, "unset it"),
    ("0.8.3", "sha256", {}, None),
    ("0.9.2", "builtin", {"PYTHONHASHSEED": "0"}, "hash(None)"),
])
def test_vllm_hash_determinism_guard(version: str, algo: str | None, env: dict[str, str],
                                     problem: str | None) -> None:
    if problem is None:
        check_vllm_hash_determinism(version, algo, env)
    else:
        with pytest.raises(UnsafeHashingError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            check_vllm_hash_determinism(version, algo, env)
