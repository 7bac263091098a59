"""V0 tests run only inside an env whose REAL vLLM has the V0 engine (0.8.3-0.10.0).

Build one with ``python scripts/make_vllm_env.py 0.10.0`` and run
``tox -e contract-vllm0100`` (or ``python scripts/make_vllm_env.py 0.10.0 --run --
python -m pytest tests/v0``). In the main venv (vLLM 0.32, no V0) the whole
directory is skipped with that instruction.
"""

from __future__ import annotations

import os

import pytest

from mooncake_vllm.compat import installed_vllm, vllm_facts

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # vLLM 0.8.5's V0 imports torch.compile at import


def _v0_reason() -> str | None:
    dist = installed_vllm()
    if dist is None:
        return "no vLLM installed"
    facts = vllm_facts(dist.version, strict=False)
    if not facts.v0_kv_connectors:
        return (f"vLLM {dist.version} has no V0 KV connectors; run inside an old-vLLM env: "
                f"`tox -e contract-vllm0100` (scripts/make_vllm_env.py 0.10.0)")
    return None


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def dev(request: pytest.FixtureRequest) -> str:
    """Where the KV caches and batch tensors live (``cuda``: skipped without a GPU)."""
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.fspath).startswith(here)]
    for item in mine:
        item.add_marker(pytest.mark.v0)  # what the compat table counts as V0 evidence
    reason = _v0_reason()
    if reason is not None:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=reason))
