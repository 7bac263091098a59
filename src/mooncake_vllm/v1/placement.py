"""Where the pool's threads run: off vLLM's compute cores, or below vLLM's priority.

vLLM's CPU backend may pin its worker to compute cores; the pool's threads (the
save and load threads, the time-box workers they start, Mooncake's transfer
threads) then move to the other cores. Where no core is free of vLLM's compute
(vLLM does not pin, or pins every core), they run ``MOONCAKE_VLLM_THREAD_NICE``
(default 10) nice levels below the thread that starts them, so that a transfer
never takes a core from a forward pass on equal terms. Threads inherit their
creator's priority, so the threads those threads start run below vLLM too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from mooncake_vllm.errors import ConfigError, ConfigProblem

__all__ = ["THREAD_AFFINITY_ENV", "THREAD_NICE_ENV", "off_compute_cores", "thread_nice"]

THREAD_AFFINITY_ENV = "MOONCAKE_VLLM_THREAD_AFFINITY"
THREAD_NICE_ENV = "MOONCAKE_VLLM_THREAD_NICE"
DEFAULT_NICE = 10
_MAX_NICE = 19


def thread_nice(environ: Mapping[str, str] = os.environ) -> int:
    """The nice increment of the pool's threads; :class:`ConfigError` on a bad value."""
    raw = environ.get(THREAD_NICE_ENV, "").strip()
    if not raw:
        return DEFAULT_NICE
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= _MAX_NICE:
        raise ConfigError(f"${THREAD_NICE_ENV}", [ConfigProblem(
            THREAD_NICE_ENV, f"must be an integer from 0 to {_MAX_NICE}, found {raw!r}",
            f"unset it (default {DEFAULT_NICE}), or 0 to leave the pool's threads at vLLM's "
            "priority")])
    return value


def off_compute_cores() -> None:
    """Move the calling thread off vLLM's compute cores, or below its priority."""
    if os.environ.get(THREAD_AFFINITY_ENV, "on") == "off":
        return
    try:
        compute = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - compute
        if others:
            os.sched_setaffinity(0, others)  # pid 0 = this thread only
            return
    except (AttributeError, OSError):  # not Linux, or a cpuset forbids it
        pass
    _lower_priority()


def _lower_priority() -> None:
    try:
        step = thread_nice()
    except ConfigError:
        return  # the connector refused it at start
    if not step:
        return
    tid = threading.get_native_id()  # PRIO_PROCESS with a thread id: that thread only (Linux)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(_MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + step))
    except (AttributeError, OSError):
        pass
