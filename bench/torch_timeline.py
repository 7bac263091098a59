"""Record a window of engine steps under torch.profiler (CPU ops + CUDA activity) as a trace.

Used by interference_engine.py's ``timeline`` command: the steps ``skip + warmup`` to
``skip + warmup + active - 1`` of a served workload (0-based engine steps), each a
``ProfilerStep#N`` range, vLLM's own scopes where ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``
and our hooks' ``mcv:<hook>`` ranges (``HookTimer.annotate``); the chrome trace is written
gzipped. ``bench/timeline_table.py`` reads it.
"""

from __future__ import annotations

import gzip
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["WARMUP", "record"]

#: profiler warm-up steps (recorded, then dropped) before the active window
WARMUP = 2


def _experimental() -> Any:
    """Every thread's ops (our save and load threads beside vLLM's) and CUDA's waits, where
    this torch has them (``profile_all_threads``: torch >= 2.8, unverified before)."""
    from torch._C._profiler import _ExperimentalConfig

    for kwargs in ({"profile_all_threads": True, "enable_cuda_sync_events": True},
                   {"enable_cuda_sync_events": True}, {}):
        try:
            return _ExperimentalConfig(**kwargs)
        except TypeError:
            continue
    return None


def record(run: Callable[[Callable[[], Any]], None], path: Path, *, skip: int,
           active: int) -> dict[str, Any]:
    """``run(after_step)`` serves the workload, calling ``after_step`` after each engine step;
    the window's trace goes to ``path`` + ``.gz``. Returns where and which steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    written: list[int] = []

    def ready(prof: Any) -> None:
        prof.export_chrome_trace(str(path))
        with path.open("rb") as src, gzip.open(f"{path}.gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        written.append(path.stat().st_size)
        path.unlink()

    with profile(activities=activities, schedule=schedule(wait=skip, warmup=WARMUP, active=active,
                                                          repeat=1),
                 on_trace_ready=ready, record_shapes=False, with_stack=False,
                 experimental_config=_experimental()) as prof:
        run(prof.step)
    gz = Path(f"{path}.gz")
    return {"trace": gz.name if gz.exists() else None, "json_bytes": written[0] if written else 0,
            "gz_bytes": gz.stat().st_size if gz.exists() else 0,
            "window": [skip + WARMUP, skip + WARMUP + active]}
