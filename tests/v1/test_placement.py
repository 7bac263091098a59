"""The pool's threads off vLLM's cores or below its priority: real threads, real priorities."""

from __future__ import annotations

import os
import threading

import pytest

from mooncake_vllm.errors import ConfigError
from mooncake_vllm.v1.placement import (
    DEFAULT_NICE,
    THREAD_AFFINITY_ENV,
    THREAD_NICE_ENV,
    off_compute_cores,
    thread_nice,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


def _placed(cores: set[int]) -> tuple[int, set[int], int]:
    """Nice before, affinity after and nice after ``off_compute_cores`` in a fresh thread on ``cores``."""
    out: list[object] = []

    def run() -> None:
        tid = threading.get_native_id()
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:
            out.append(exc)
            return
        before = os.getpriority(os.PRIO_PROCESS, tid)
        off_compute_cores()
        out.extend([before, os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, tid)])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if isinstance(out[0], OSError):
        pytest.skip(f"cannot set this thread's affinity here: {out[0]}")
    return out[0], out[1], out[2]  # type: ignore[return-value]


def _all_cores() -> set[int]:
    return set(os.sched_getaffinity(0))


def test_sharing_every_core_runs_the_thread_below_its_creator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREAD_NICE_ENV, raising=False)
    monkeypatch.delenv(THREAD_AFFINITY_ENV, raising=False)
    if set(range(os.cpu_count() or 1)) != _all_cores():
        pytest.skip("this process may not run on every core: no thread can share all of them")
    before, cores, after = _placed(_all_cores())
    assert cores == _all_cores()
    assert after == min(19, before + DEFAULT_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # only that thread


def test_a_spare_core_moves_the_thread_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREAD_NICE_ENV, raising=False)
    cores = _all_cores()
    if len(cores) < 2 or set(range(os.cpu_count() or 1)) != cores:
        pytest.skip("needs two cores this process may use")
    compute = min(cores)
    before, placed, after = _placed({compute})
    assert placed == cores - {compute} and after == before


@pytest.mark.parametrize("env", [{THREAD_NICE_ENV: "0"}, {THREAD_AFFINITY_ENV: "off"}])
def test_switched_off_leaves_priority_alone(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before, cores, after = _placed(_all_cores())
    assert after == before and cores == _all_cores()


def test_thread_nice_values() -> None:
    assert thread_nice({}) == DEFAULT_NICE
    assert thread_nice({THREAD_NICE_ENV: " 3 "}) == 3
    assert thread_nice({THREAD_NICE_ENV: "0"}) == 0
    for bad in ("20", "-1", "low", "1.5"):
        with pytest.raises(ConfigError) as err:
            thread_nice({THREAD_NICE_ENV: bad})
        assert err.value.fields == [THREAD_NICE_ENV] and repr(bad) in str(err.value)


def test_the_connector_refuses_a_bad_value_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from mooncake_vllm.v1.connector import MooncakeStoreConnector

    monkeypatch.setenv(THREAD_NICE_ENV, "99")
    with pytest.raises(ConfigError, match=THREAD_NICE_ENV):
        MooncakeStoreConnector(SimpleNamespace(), KVConnectorRole.WORKER)
