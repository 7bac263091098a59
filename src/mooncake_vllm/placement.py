"""Where the pool's threads run: off vLLM's compute cores, or below vLLM's priority.

vLLM's CPU backend may pin its worker to compute cores; the pool's threads (the
save, load, audit, hand-off and probe threads, every time-box worker, Mooncake's
transfer threads) then move to the other cores. Where no core is free of vLLM's
compute (vLLM does not pin, or pins every core), they run ``MOONCAKE_VLLM_THREAD_NICE``
(default 10) nice levels below vLLM's thread, so that a transfer never takes a core
from a forward pass on equal terms. Mooncake's own threads inherit the placement of
ours that start them.

Where they go is decided once per process, from the first thread that asks — one of
vLLM's (the connector notes it when it starts, :func:`note_compute_cores`): a thread of
ours that starts another (the save thread its put workers, a time-box its workers) has
already moved, and deciding from its CPUs would send the new thread onto vLLM's.

"The other cores" are the process's own: those its first thread to import this module
could use (vLLM's plugin loader imports it at start, before its CPU backend pins a
worker). A process the operator gave cores 4-7 (``taskset``, a cpuset) keeps the pool's
threads on 4-7 — below vLLM's priority where vLLM computes on all four — and never moves
them to cores the process was not given. A vLLM CPU worker is the exception: vLLM starts
it with an OpenMP binding (``GOMP_CPU_AFFINITY``, ...) that narrows its first thread when
torch loads, before any plugin runs; there "the process's cores" are every core, as
before (with ``taskset`` around such a worker the pool's threads may leave its cores).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from mooncake_vllm.errors import ConfigError, ConfigProblem

__all__ = ["OMP_BINDINGS", "THREAD_AFFINITY_ENV", "THREAD_NICE_ENV", "note_compute_cores",
           "off_compute_cores", "process_cpus",
           "thread_affinity", "thread_nice"]

THREAD_AFFINITY_ENV = "MOONCAKE_VLLM_THREAD_AFFINITY"
THREAD_NICE_ENV = "MOONCAKE_VLLM_THREAD_NICE"
DEFAULT_NICE = 10
_MAX_NICE = 19


def thread_affinity(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the pool's threads are placed (``on``, the default) or left alone (``off``);
    :class:`ConfigError` on any other value (a ``0`` or ``false`` must not pass for ``off``)."""
    raw = environ.get(THREAD_AFFINITY_ENV, "").strip()
    if raw.lower() in ("", "on"):
        return True
    if raw.lower() == "off":
        return False
    raise ConfigError(f"${THREAD_AFFINITY_ENV}", [ConfigProblem(
        THREAD_AFFINITY_ENV, f"must be on or off, found {raw!r}",
        "unset it (default on: the pool's threads keep off vLLM's compute cores, or below its "
        "priority), or off to leave their affinity and priority alone")])


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


class _Decision:
    """Where the pool's threads go: ``cpus`` (empty: no core free of vLLM's) and the
    priority of the vLLM thread that decided (``base_nice``)."""

    __slots__ = ("cpus", "base_nice")

    def __init__(self, cpus: frozenset[int], base_nice: int) -> None:
        self.cpus, self.base_nice = cpus, base_nice


def _thread_cpus() -> frozenset[int]:
    """The calling thread's CPUs (empty where the platform cannot say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux, or a cpuset forbids asking
        return frozenset()


#: OpenMP settings that bind a process's first thread to CPUs when the runtime loads (vLLM's
#: CPU backend sets one for each worker it starts: that worker is narrowed before any plugin
#: can note the process's cores)
OMP_BINDINGS = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES")


def process_cpus(environ: Mapping[str, str] = os.environ,
                 thread_cpus: frozenset[int] | None = None) -> frozenset[int]:
    """The cores this process was given: the calling thread's (call it before vLLM pins any:
    ``taskset -c 4-7`` or a cpuset gives every thread 4-7), unless an OpenMP binding in
    ``environ`` may already have narrowed it — then every core (a cpuset still limits where
    a thread can be moved)."""
    mine = _thread_cpus() if thread_cpus is None else thread_cpus
    if any(environ.get(name) for name in OMP_BINDINGS):
        return frozenset(range(os.cpu_count() or 1)) | mine
    return mine


_lock = threading.Lock()
_decided: _Decision | None = None
#: the cores this process was given, as the first thread to import this module saw them
_process_cpus: frozenset[int] = process_cpus()


def note_compute_cores() -> None:
    """Decide, from the calling thread (one of vLLM's: its CPUs and priority), where the
    pool's threads go. The first call in a process decides; later ones change nothing."""
    global _decided
    with _lock:
        if _decided is not None:
            return
        others = _process_cpus - _thread_cpus()
        try:
            base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        except (AttributeError, OSError):
            base = 0
        _decided = _Decision(others, base)


def off_compute_cores() -> None:
    """Move the calling thread (one of the pool's) off vLLM's compute cores, or below its
    priority (as decided by :func:`note_compute_cores`). Idempotent."""
    try:
        if not thread_affinity():
            return
    except ConfigError:
        return  # the connector refused it at start
    note_compute_cores()
    decided = _decided
    if decided is None:  # unreachable: note_compute_cores decided
        return
    if decided.cpus:
        try:
            os.sched_setaffinity(0, decided.cpus)  # pid 0 = this thread only
            return
        except OSError:  # a cpuset forbids it
            pass
    _lower_priority(decided.base_nice)


def _lower_priority(base: int) -> None:
    """This thread ``thread_nice()`` levels below vLLM's (``base``), once: a thread started
    by one already lowered inherits its priority, and stays there."""
    try:
        step = thread_nice()
    except ConfigError:
        return  # the connector refused it at start
    if not step:
        return
    tid = threading.get_native_id()  # PRIO_PROCESS with a thread id: that thread only (Linux)
    try:
        target = min(_MAX_NICE, base + step)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except (AttributeError, OSError):
        pass
