"""Does a put slow vLLM's thread through its process (the GIL) or through the machine?

Issue 24's timeline found every op on vLLM's engine thread 10-15 % slower while a step's
saves were put, with the pool's threads on other cores. This probe separates the causes
in one run: a main thread runs a launch-bound "step" (Python between small torch ops,
CUDA where there is a GPU, then a sync of its own stream: what an eager forward looks like to the CPU) over
and over, pinned to one core, while, in turn:

    quiet     nothing else
    threads   ``--workers`` threads of this process put 2 MiB blocks from registered
              pinned memory with Mooncake's ``batch_put_from`` at ``--rates`` (MB/s, all
              workers together), each with its own store client: what our save lanes do
    procs     the same puts from as many child processes (each its own interpreter and GIL)
    copy      threads of this process copying the same bytes host to host with torch (the
              GIL released): memory traffic with no network stack and no Mooncake
    capture   our connector's capture of a request's 6 blocks of 2 MiB (a KV cache on the GPU
              where there is one) on the main thread between its steps, as vLLM's thread
              captures in ``wait_for_save``; a save thread placed as the connector's hands
              the slots back without putting (the bench's ``ours-noput``)
    ours      the same captures, and the save thread puts them as the connector does
              (checksums, framing, puts over ``--workers`` store clients): ``ours`` over
              ``capture`` is what our puts cost vLLM's thread from inside its process

Conditions are interleaved for ``--rounds`` rounds; each reports the step's median, mean
and p90, its ratio to the quiet median of its round and the IPIs that reached the pinned
core (TLB shootdowns, function calls, reschedules). Threads slower than processes means the
in-process part (the GIL, the allocator, a shared address space) costs vLLM's thread; both
equally slow means the machine (caches, memory, the TCP stack) does. ``--kinds`` picks the
conditions. ``--python-only``: the
main thread runs Python alone, so it grows only by the GIL others take (and its core).
The pool is ``$MOONCAKE_CONFIG_PATH`` (scripts/gpu/mc_up.sh), or ``--local-stack`` starts one::

    python3 bench/put_interference.py --out $OUT/put_interference.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proc_census import cpu_delta, thread_cpu, threads_allowed_on

__all__ = ["in_process_excess", "interrupts", "main", "summarize"]

BLOCK = 2 << 20
BATCH = 8
#: the conditions a round runs after ``quiet`` (module docstring)
KINDS = ("threads", "procs", "copy", "capture", "ours")


def _torch_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _pinned(nbytes: int) -> Any:
    import torch
    buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf.pin_memory() if torch.cuda.is_available() else buf


def _paced(seconds: float, rate: float, unit: int, step: Callable[[int], int]) -> tuple[int, int]:
    """``step(i)`` for i = 0, 1, ... for ``seconds``, each moving ``unit`` bytes, at ``rate``
    bytes/s (sleeping when ahead); how many steps ran, and the sum of what they returned."""
    done, steps, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += step(steps)
        steps += 1
        ahead = start + steps * unit / rate - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
    return steps, done


class _Putter:
    """One store client putting ``BATCH`` blocks a call from its own registered buffer."""

    def __init__(self, name: str) -> None:
        from mooncake_vllm.config import load_store_config
        from mooncake_vllm.store.connect import open_store

        self.name = name
        self.store = open_store(load_store_config(), timeout=60).store
        self.buf = _pinned(BATCH * BLOCK)
        if self.store.register_buffer(self.buf.data_ptr(), BATCH * BLOCK) != 0:
            raise RuntimeError("register_buffer failed")
        self.ptrs = [self.buf.data_ptr() + i * BLOCK for i in range(BATCH)]

    def run(self, tag: str, seconds: float, rate: float) -> int:
        """Put at ``rate`` bytes/s for ``seconds``; the bytes put."""
        def put(i: int) -> int:
            keys = [f"put-interference/{tag}/{self.name}/{i}/{j}" for j in range(BATCH)]
            codes = self.store.batch_put_from(keys, self.ptrs, [BLOCK] * BATCH)
            return BLOCK * sum(1 for c in codes if c == 0)

        calls, stored = _paced(seconds, rate, BATCH * BLOCK, put)
        for j in range(calls):  # leave the pool as found
            for k in range(BATCH):
                self.store.remove(f"put-interference/{tag}/{self.name}/{j}/{k}")
        return stored


class _OursSaver:
    """Our :class:`~mooncake_vllm.store.StoreClient` saving a request's blocks at a time."""

    BLOCKS = 6  # one request's ~96 new tokens of an 8B-class model (mixed serving's saves)

    def __init__(self, lanes: int, device: str) -> None:
        import torch

        from mooncake_vllm.config import load_store_config
        from mooncake_vllm.layout import BlockLayout
        from mooncake_vllm.store import StagingSizes, StoreClient

        # 32 layers of [2, blocks, 16 tokens, 8 heads, 128] bf16: 2 MiB a block, as the 8B model
        self.kv = [torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16, device=device)
                   for _ in range(32)]
        self.layout = BlockLayout.from_kv_caches(self.kv)
        self.client = StoreClient.connect(load_store_config(), timeout=60,
                                          staging=StagingSizes(save_cuda=256 << 20, load=64 << 20))
        self.client.register_layout(self.layout, clients=lanes)

    def capture(self, tag: str, i: int) -> Any:
        """Capture save ``i`` of ``tag`` on this thread, as the connector captures: vLLM's
        stream does not wait for the copy (the probe never changes the blocks, so no fence
        is ordered before their reuse)."""
        keys = [f"put-interference-ours/{tag}/{i}/{j}" for j in range(self.BLOCKS)]
        ids = [(i * self.BLOCKS + j) % 64 for j in range(self.BLOCKS)]
        return self.client.prepare_save(keys, self.layout, ids, defer_fence=True)

    def start(self, tag: str, rate: float, put: bool) -> _SaveRun:
        """Saves at ``rate`` bytes/s captured by the caller's thread, put (or, without ``put``,
        handed back) by a save thread."""
        return _SaveRun(self, tag, rate, put)


class _SaveRun:
    """The connector's save path in the probe: :meth:`between_steps` captures on the calling
    (engine) thread when a save is due; a save thread, placed as the connector places its
    threads, commits each capture (or discards it) in order."""

    def __init__(self, saver: _OursSaver, tag: str, rate: float, put: bool) -> None:
        import queue

        self.saver, self.tag, self.put = saver, tag, put
        self.unit = saver.BLOCKS * saver.layout.block_nbytes
        self.interval = self.unit / rate
        self.captured, self.stored = 0, 0
        self.tickets: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._commit_all, name="mcv-save")
        self.start_at = time.perf_counter()
        self.thread.start()

    def between_steps(self) -> None:
        """Capture the saves now due (the engine thread's share of saving)."""
        while self.start_at + self.captured * self.interval <= time.perf_counter():
            self.tickets.put(self.saver.capture(self.tag, self.captured))
            self.captured += 1

    def _commit_all(self) -> None:
        from mooncake_vllm.placement import off_compute_cores

        off_compute_cores()
        client, nbytes = self.saver.client, self.saver.layout.block_nbytes
        while (ticket := self.tickets.get()) is not None:
            if self.put:
                self.stored += nbytes * client.commit_save(ticket)
            else:
                self.stored += nbytes * len(ticket.keys)
                client.discard(ticket)

    def finish(self) -> int:
        """Stop; the bytes stored (put, or captured and handed back); the pool left as found."""
        self.tickets.put(None)
        self.thread.join()
        self.saver.client.remove_matching(f"put-interference-ours/{self.tag}/.*")
        return self.stored


def _proc_main(name: str, cpus: list[int], jobs: Any, done: Any) -> None:
    os.sched_setaffinity(0, cpus)
    # this process has no engine thread: placing "off the compute cores" from here would send
    # its Mooncake threads onto every core but ``cpus`` (the main core among them); they keep
    # ``cpus``
    os.environ["MOONCAKE_VLLM_THREAD_AFFINITY"] = "off"
    putter = _Putter(name)
    main_cpu = min(set(range(os.cpu_count() or 1)) - set(cpus), default=None)
    if main_cpu is not None and (beside := threads_allowed_on(main_cpu)):
        print(f"{name}: {len(beside)} thread(s) allowed on the main core", flush=True)
    done.put(("ready", 0))
    while (job := jobs.get()) is not None:
        done.put((name, putter.run(*job)))


def _put_off(putter: _Putter, tag: str, seconds: float, rate: float, cpus: list[int],
             out: list[int]) -> None:
    """A thread of this process putting through its own store client, on ``cpus``."""
    os.sched_setaffinity(0, cpus)
    out.append(putter.run(tag, seconds, rate))


def _copy(seconds: float, rate: float, cpus: list[int], out: list[int]) -> None:
    import torch
    os.sched_setaffinity(0, cpus)
    src, dst = _pinned(BATCH * BLOCK), torch.empty(BATCH * BLOCK, dtype=torch.uint8)

    def copy(_: int) -> int:
        dst.copy_(src)
        return BATCH * BLOCK

    out.append(_paced(seconds, rate, BATCH * BLOCK, copy)[1])


#: /proc/interrupts rows counted per condition: IPIs that interrupt a core running this
#: process's threads (a TLB shootdown reaches every core its address space runs on)
IPI_ROWS = ("TLB", "CAL", "RES")


def interrupts(cpu: int, text: str | None = None) -> dict[str, int]:
    """This CPU's count of each :data:`IPI_ROWS` row of ``/proc/interrupts`` (``{}`` without it)."""
    if text is None:
        try:
            text = Path("/proc/interrupts").read_text()
        except OSError:
            return {}
    lines = text.splitlines()
    cpus = lines[0].split() if lines else []
    column = cpus.index(f"CPU{cpu}") if f"CPU{cpu}" in cpus else None
    out: dict[str, int] = {}
    for line in lines[1:]:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name.strip() in IPI_ROWS and column is not None and column < len(fields):
            out[name.strip()] = int(fields[column])
    return out


def _steps(seconds: float, ops: int, device: str, python_only: bool = False,
           between: Callable[[], None] | None = None) -> list[float]:
    """The main thread's emulated engine steps (ms each) for ``seconds``. ``python_only``:
    Python alone, never releasing the GIL itself — a step then runs longer only by what other
    threads of this process take of the GIL (switch requests every ``sys.getswitchinterval()``)
    and what the OS takes of its core. ``between``: run at each step's start, inside its time
    (the connector's capture on vLLM's thread)."""
    table: dict[int, float] = {}
    before = between or (lambda: None)

    def python_step() -> None:
        before()
        for i in range(ops * 20):
            table[i % 64] = table.get(i % 64, 0.0) + i * 0.5

    if python_only:
        return _timed(seconds, python_step)
    import torch
    x = torch.ones(4096, device=device)

    def step() -> None:
        nonlocal x
        before()
        for i in range(ops):
            table[i % 64] = table.get(i % 64, 0.0) + i * 0.5  # the Python between ops
            x = torch.add(x, 1.0)
        if device == "cuda":
            # vLLM waits for its own stream's work (the sampled tokens' event), never the
            # device's: a device-wide sync also waited for the capture's copies on our save
            # stream (the 2026-12-06 12:55 capture@1600 figure, 1.12, included that wait)
            torch.cuda.current_stream().synchronize()
        else:
            float(x[0])

    return _timed(seconds, step)


def _timed(seconds: float, step: Callable[[], None]) -> list[float]:
    """``step()`` over and over for ``seconds``; each one's ms."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def summarize(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    """Per condition: median / mean / p90 step ms and their ratios to its round's quiet
    (``vs_quiet_median``, ``vs_quiet_mean``: the median over rounds of each). The median is
    the typical step; the mean carries the rare steps that capture, and all the time lost."""
    rows: dict[str, list[dict[str, Any]]] = {}
    quiet: dict[int, tuple[float, float]] = {}
    for c in conditions:
        if c["name"] == "quiet":
            quiet[c["round"]] = (statistics.median(c["steps_ms"]), statistics.fmean(c["steps_ms"]))
    for c in conditions:
        steps = sorted(c["steps_ms"])
        med, mean = statistics.median(steps), statistics.fmean(steps)
        q = quiet.get(c["round"])
        rows.setdefault(c["name"], []).append({
            "round": c["round"], "median_ms": round(med, 3), "mean_ms": round(mean, 3),
            "p90_ms": round(steps[int(0.9 * (len(steps) - 1))], 3),
            "vs_quiet": round(med / q[0], 3) if q else None,
            "mean_vs_quiet": round(mean / q[1], 3) if q else None,
            "MBps": round(c.get("bytes", 0) / c["seconds"] / 1e6, 1),
            "ipis_per_s": {k: round(v / c["seconds"]) for k, v in c.get("ipis", {}).items()}})

    def over_rounds(r: list[dict[str, Any]], key: str) -> float | None:
        got = [x[key] for x in r if x[key] is not None]
        return round(statistics.median(got), 3) if got else None
    return {name: {"rounds": r, "vs_quiet_median": over_rounds(r, "vs_quiet"),
                   "vs_quiet_mean": over_rounds(r, "mean_vs_quiet")} for name, r in rows.items()}


def in_process_excess(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per rate, what the same puts cost the pinned thread from inside its process beyond what
    they cost from other processes: ``threads`` over ``procs`` (Mooncake's calls alone) and
    ``ours`` over ``capture`` (our save thread's puts, the captures on both sides), beside
    ``procs`` itself (over quiet: the machine's share); each of the step's median and, after
    ``mean:``, of its mean. A ratio above ``procs`` means sharing vLLM's process is the cost;
    at or below it, the machine is."""
    out: dict[str, dict[str, float]] = {}
    pairs = {"threads": "procs", "ours": "capture"}
    for name, row in summary.items():
        kind, _, rate = name.partition("@")
        for stat, prefix in (("vs_quiet_median", ""), ("vs_quiet_mean", "mean:")):
            mine = row.get(stat)
            if mine is None:
                continue
            if kind == "procs":
                out.setdefault(rate, {})[f"{prefix}procs"] = mine
            base = summary.get(f"{pairs.get(kind)}@{rate}", {}).get(stat)
            if base:
                out.setdefault(rate, {})[f"{prefix}{kind}/{pairs[kind]}"] = round(mine / base, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="put_interference.json")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rates", default="400,1600", help="MB/s of all workers together")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"conditions besides quiet, in their order in a round ({', '.join(KINDS)})")
    ap.add_argument("--ops", type=int, default=1000, help="torch ops per emulated step")
    ap.add_argument("--python-only", action="store_true",
                    help="the main thread runs Python alone (no torch op releases the GIL): its "
                         "steps then grow only by the GIL other threads of the process take")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (s; Python's default 0.005): how long "
                         "a thread waiting for the GIL lets its holder run on")
    ap.add_argument("--local-stack", action="store_true", help="start a Mooncake stack (CPU dry run)")
    args = ap.parse_args()
    if unknown := set(args.kinds.split(",")) - set(KINDS) - {""}:
        ap.error(f"--kinds: no condition {sorted(unknown)} (choose from {', '.join(KINDS)})")
    if args.switch_interval is not None:
        import sys
        sys.setswitchinterval(args.switch_interval)
    if not args.local_stack:
        _run(args)
        return
    import tempfile

    from mooncake_vllm.services import LocalStack

    work = Path(tempfile.mkdtemp(prefix="put-interference-"))
    with LocalStack(work / "stack", segment_size=2 << 30, local_buffer_size=256 << 20) as stack:
        cfg = work / "mooncake_config.json"
        cfg.write_text(json.dumps(stack.config()))
        os.environ.update({**stack.env(), "MOONCAKE_CONFIG_PATH": str(cfg),
                           "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"})
        _run(args)


def _run(args: argparse.Namespace) -> None:
    cores = sorted(os.sched_getaffinity(0))
    main_cpu, others = cores[:1], cores[1:] or cores
    device = _torch_device()
    ctx = mp.get_context("spawn")
    jobs, done = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_proc_main, args=(f"p{i}", others, jobs, done), daemon=True)
             for i in range(args.workers)]
    for p in procs:
        p.start()
    threads: list[_Putter] = []
    # as the connector does on vLLM's thread, before any thread of ours starts: the first
    # thread to ask decides which cores are "compute" (one of the putters' openers asking
    # first sent every thread of ours onto the main core); the module notes the process's
    # cores when imported, before this thread narrows to one, as vLLM's plugin loader does
    from mooncake_vllm.placement import note_compute_cores
    os.sched_setaffinity(0, main_cpu)  # this thread only: the emulated engine thread
    note_compute_cores()

    def _open() -> None:  # Mooncake's own threads start here: they keep this thread's CPUs
        os.sched_setaffinity(0, others)
        threads.extend(_Putter(f"t{i}") for i in range(args.workers))
    opener = threading.Thread(target=_open)
    opener.start()
    opener.join()
    if len(threads) < args.workers:
        raise RuntimeError("a store client of this process did not open")
    ours = _OursSaver(args.workers, device)
    for _ in procs:
        done.get(timeout=120)
    _steps(1.0, args.ops, device, args.python_only)  # warm-up
    warm = ours.start("warm-up", 100e6, put=True)  # the lanes' first puts open their connections
    _steps(2.0, args.ops, device, args.python_only, warm.between_steps)
    warm.finish()
    beside = threads_allowed_on(main_cpu[0])
    print(f"threads of this process allowed on the main core besides it: {len(beside)} "
          f"{sorted(set(beside))}", flush=True)
    conditions: list[dict[str, Any]] = []
    rates = [float(r) * 1e6 for r in args.rates.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]  # checked in main(), before any setup
    for rnd in range(args.rounds):
        plan = [("quiet", 0.0)] + [(kind, r) for r in rates for kind in kinds]
        for name, rate in plan:
            tag, per = f"{name}-{rnd}-{int(rate)}", rate / args.workers
            moved: list[int] = []
            bg: list[threading.Thread] = []
            saves = ours.start(tag, rate, put=name == "ours") if name in ("capture", "ours") else None
            if name == "threads":
                bg = [threading.Thread(target=_put_off, args=(p, tag, args.seconds, per, others, moved))
                      for p in threads]
            elif name == "copy":
                bg = [threading.Thread(target=_copy, args=(args.seconds, per, others, moved))
                      for _ in range(args.workers)]
            elif name == "procs":
                for _ in procs:
                    jobs.put((tag, args.seconds, per))
            for t in bg:
                t.start()
            before, cpu_before = interrupts(main_cpu[0]), thread_cpu()
            steps = _steps(args.seconds, args.ops, device, args.python_only,
                           saves.between_steps if saves else None)
            after, cpu_after = interrupts(main_cpu[0]), thread_cpu()
            for t in bg:
                t.join()
            if saves is not None:
                moved = [saves.finish()]
            if name == "procs":
                moved = [done.get(timeout=120)[1] for _ in procs]
            label = name if name == "quiet" else f"{name}@{int(rate / 1e6)}"
            ipis = {k: after[k] - before.get(k, 0) for k in after}
            busy = {k: v for k, v in list(cpu_delta(cpu_before, cpu_after).items())[:8] if v >= 0.05}
            conditions.append({"name": label, "round": rnd, "seconds": args.seconds,
                               "steps_ms": steps, "bytes": sum(moved), "ipis": ipis,
                               "threads_cpu_s": busy})
            print(f"{label:14s} round {rnd}: step median {statistics.median(steps):.3f} ms, "
                  f"{sum(moved) / args.seconds / 1e6:.0f} MB/s, IPIs on the main core {ipis}, "
                  f"busiest threads (CPU s) {busy}",
                  flush=True)
    for _ in procs:
        jobs.put(None)
    ours.client.close()
    import sys
    result = {"device": device, "cores": len(cores), "workers": args.workers, "ops": args.ops,
              "switch_interval": sys.getswitchinterval(), "sharing_main_core": beside,
              "python_only": args.python_only,
              "summary": summarize(conditions), "conditions": conditions}
    result["in_process_excess"] = in_process_excess(result["summary"])
    Path(args.out).write_text(json.dumps(result))
    for name, row in result["summary"].items():
        print(f"{name:14s} step median vs quiet {row['vs_quiet_median']}, mean "
              f"{row['vs_quiet_mean']}  (rounds: "
              + ", ".join(f"{r['median_ms']} ms / mean {r['mean_ms']} / p90 {r['p90_ms']}"
                          f" / IPIs/s {r['ipis_per_s']}" for r in row["rounds"]) + ")")
    for rate, ratios in result["in_process_excess"].items():
        print(f"in-process excess @{rate} MB/s: {ratios}")


if __name__ == "__main__":
    main()
