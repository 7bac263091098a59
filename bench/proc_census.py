"""What an engine process of the GPU benches is made of, read from inside it (Linux /proc).

Per mixed rep (interference_engine.py): the objects the collector tracks, CPU seconds per
thread, resident memory and each thread's allowed CPUs — which threads ran beside vLLM's
engine thread (ours, Mooncake's C++ threads) and where.
"""

from __future__ import annotations

import collections
import gc
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["cpu_delta", "gc_census", "rss_mib", "thread_affinity", "thread_cpu", "threads_allowed_on"]


def gc_census(top: int = 12) -> dict[str, Any]:
    """Objects the collector tracks, the commonest types, and its passes so far: a count that
    grows rep by rep is a leak, and each full pass then walks more (every step slows)."""
    objs = gc.get_objects()
    kinds = collections.Counter(type(o).__name__ for o in objs)
    out = {"objects": len(objs), "types": dict(kinds.most_common(top)),
           "passes": [s["collections"] for s in gc.get_stats()], "frozen": gc.get_freeze_count()}
    del objs
    return out


def _threads() -> Iterator[tuple[str, Path]]:
    """``(name, /proc task folder)`` of each live thread: Python threads by their names,
    the others (Mooncake's, torch's) by their kernel names; a thread that ended is skipped."""
    named = {t.native_id: t.name for t in threading.enumerate()}
    for task in Path("/proc/self/task").iterdir():
        try:
            yield named.get(int(task.name)) or (task / "comm").read_text().strip(), task
        except OSError:
            continue


def thread_cpu() -> dict[str, float]:
    """CPU seconds each thread has used, summed by thread name: the difference between two
    calls (:func:`cpu_delta`) says which threads ran meanwhile."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name, task in _threads():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per thread name between two :func:`thread_cpu` calls (busiest first)."""
    delta = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in delta.items() if v > 0), key=lambda kv: -kv[1]))


def _cpus_text(cpus: list[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else str(cpus)


def thread_affinity() -> dict[str, list[str]]:
    """The allowed CPUs of the threads of each name (``first-last`` or a list; one entry per
    distinct set: four store clients' ``mc-tcp-io-0`` threads may sit apart)."""
    out: dict[str, list[str]] = {}
    for name, task in _threads():
        try:
            text = _cpus_text(sorted(os.sched_getaffinity(int(task.name))))
        except OSError:
            continue
        if text not in out.setdefault(name, []):
            out[name].append(text)
    return out


def threads_allowed_on(cpu: int) -> list[str]:
    """Names of the threads allowed on ``cpu``, the calling thread's apart."""
    me = str(threading.get_native_id())
    out = []
    for name, task in _threads():
        try:
            if task.name != me and cpu in os.sched_getaffinity(int(task.name)):
                out.append(name)
        except OSError:
            continue
    return out


def rss_mib() -> float:
    """This process's resident memory (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return -1.0
