"""``mooncake-vllm demo``: the table logic, and one real end-to-end run (2-layer model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mooncake_vllm.cli.demo import summarize
from tests.v1.instances import loads_here


def _result(ttft: float, tokens: list[int], hits: float) -> dict:
    return {"results": [{"ttft_s": ttft, "tokens": tokens}],
            "metrics": {"vllm:external_prefix_cache_hits": hits}}


@pytest.fixture
def counting_vllm(monkeypatch):  # type: ignore[no-untyped-def]
    """The table logic as on a vLLM that counts connector hits (0.11.1+), whatever is installed."""
    from mooncake_vllm.demo import run

    monkeypatch.setattr(run, "installed_facts", lambda: SimpleNamespace(external_hit_counter=True))


@pytest.mark.usefixtures("counting_vllm")
def test_summary_reports_pool_tokens_speed_and_identity() -> None:
    table, ok = summarize(_result(2.0, [1, 2, 3], 0), _result(0.5, [1, 2, 3], 1920), 2000)
    assert ok
    assert "1920" in table and "identical to A" in table and "4.0x faster" in table
    table, ok = summarize(_result(2.0, [1, 2, 3], 0), _result(0.5, [1, 2, 4], 1920), 2000)
    assert not ok and "DIFFERENT" in table
    _, ok = summarize(_result(2.0, [1], 0), _result(2.0, [1], 0), 2000)
    assert not ok  # nothing came from the pool


def test_summary_counts_b_cached_tokens_where_vllm_counts_no_connector_hits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from mooncake_vllm.demo import run

    monkeypatch.setattr(run, "installed_facts", lambda: SimpleNamespace(external_hit_counter=False))
    b = {"results": [{"ttft_s": 0.5, "tokens": [1, 2], "cached_tokens": 1920}], "metrics": {}}
    table, ok = summarize(_result(2.0, [1, 2], 0), b, 2000)
    assert ok and "1920" in table
    with pytest.raises(KeyError):  # nothing to count with: an error, never "0"
        summarize(_result(2.0, [1, 2], 0), {"results": [{"ttft_s": 0.5, "tokens": [1, 2]}], "metrics": {}}, 2000)


class _Metric:
    def __init__(self, name: str, value: float) -> None:
        self.name, self.value = name, value


class _LLM:
    def __init__(self, metrics: list[_Metric] | Exception) -> None:
        self.metrics = metrics

    def get_metrics(self) -> list[_Metric]:
        if isinstance(self.metrics, Exception):
            raise self.metrics
        return self.metrics


@pytest.mark.usefixtures("counting_vllm")
def test_metric_totals_never_turn_broken_metrics_into_zero_hits() -> None:
    """A failing get_metrics() or a missing counter is an error, not {} (= "0 hits", a vacuous pass)."""
    from mooncake_vllm.demo.run import PREFIX_CACHE_METRICS, _metric_totals

    full = [_Metric(n, 1.0) for n in PREFIX_CACHE_METRICS] + [_Metric("vllm:external_prefix_cache_hits", 31.0)]
    assert _metric_totals(_LLM(full))["vllm:external_prefix_cache_hits"] == 32.0  # summed over engines
    with pytest.raises(ValueError, match="prometheus"):
        _metric_totals(_LLM(ValueError("prometheus registry gone")))
    with pytest.raises(RuntimeError, match="external_prefix_cache_hits"):
        _metric_totals(_LLM([m for m in full if m.name != "vllm:external_prefix_cache_hits"]))
    with pytest.raises(KeyError):
        summarize(_result(2.0, [1], 0), {"results": [{"ttft_s": 1.0, "tokens": [1]}], "metrics": {}}, 2000)


@pytest.mark.vllm
def test_demo_runs_end_to_end_and_cleans_up(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "MOONCAKE_VLLM_CACHE": str(tiny_model.parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-c", "from mooncake_vllm.cli import main; raise SystemExit(main())",
         "demo", "--tiny", "--prompt-tokens", "300",
         "--max-tokens", "4", "--workdir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=600, env=env)
    if not loads_here():  # vLLM < 0.11.1: ours saves but never loads; the demo says so at once
        assert proc.returncode == 1 and "never loads from it there" in proc.stderr, proc.stderr
        assert "ready" not in proc.stdout  # nothing was started
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens served from the pool" in proc.stdout
    assert "identical to A" in proc.stdout
    assert " 256" in proc.stdout  # 2 full blocks of 128 of a 300-token prompt
    for line in proc.stdout.splitlines():
        if "ready" in line and "pid" in line:
            pid = int(line.split("pid", 1)[1].split()[0])
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(
                f"/proc/{pid}/status").read_text().lower(), f"pid {pid} left running"
