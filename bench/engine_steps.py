"""Drive vLLM's in-process engine step by step and stamp every token (ITL as a client sees it).

Shared by the serving benches: :class:`EngineProcess` runs an engine in its own process,
driven by commands; ``serve`` runs requests (optionally closed-loop with
``clients`` clients, optionally adding one more request mid-way), each :class:`Req`
keeps its add time, one timestamp per token and vLLM's ``num_cached_tokens``.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EngineProcess", "HookTimer", "PYSPY_REPS", "Req", "closed_loop_stats", "interference",
           "itl_stats", "other_build_env", "pct", "pyspy_record", "serve"]


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    t_add: float = 0.0
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached: int = -1  #: vLLM's num_cached_tokens (prefix cache + connector), -1: not reported
    step_add: int = -1  #: engine steps :func:`serve` had run when the request was added
    step_first: int = -1  #: ... when its first token came (that step counted)

    def ttft(self) -> float:
        return self.times[0] - self.t_add

    def ttft_steps(self) -> int:
        """Engine steps from being added to the first token (-1: not served by :func:`serve`)."""
        return self.step_first - self.step_add if self.step_first >= 0 else -1

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def serve(engine: Any, reqs: list[Req], clients: int = 1, inject: tuple[int, Req] | None = None,
          detokenize: bool = True, steps: list[float] | None = None,
          after_step: Callable[[], Any] | None = None) -> None:
    """Closed loop: ``clients`` clients, each sending its next request once its last one ended.

    ``inject=(n, req)`` adds ``req`` (outside the loop) once ``reqs[0]`` has ``n`` tokens;
    ``detokenize=False`` for engines built with ``skip_tokenizer_init``; ``steps`` gets
    every ``engine.step()``'s seconds; ``after_step`` is called after each (a profiler's
    ``step``).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    todo, live = list(reqs), {}
    n_steps = 0

    def add(r: Req) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True,
                                detokenize=detokenize, output_kind=RequestOutputKind.DELTA)
        r.t_add, r.step_add = time.perf_counter(), n_steps
        engine.add_request(r.rid, {"prompt_token_ids": r.prompt}, params)
        live[r.rid] = r

    while todo and len(live) < clients:
        add(todo.pop(0))
    while live:
        t_step = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        n_steps += 1
        if steps is not None:
            steps.append(now - t_step)
        if after_step is not None:
            after_step()
        for out in outputs:
            r = live.get(out.request_id)
            if r is None:
                continue
            new = list(out.outputs[0].token_ids)
            if new and not r.times:
                r.step_first = n_steps
            r.tokens += new
            r.times += [now] * len(new)
            if getattr(out, "num_cached_tokens", None) is not None:
                r.cached = max(r.cached, out.num_cached_tokens)
            if out.finished:
                del live[r.rid]
                if todo:
                    add(todo.pop(0))
        if inject and not inject[1].t_add and len(reqs[0].tokens) >= inject[0]:
            add(inject[1])


class HookTimer:
    """Wall time spent inside a connector class's hooks (both roles of an in-process engine).

    ``install(cls)`` wraps every hook vLLM calls per step; ``take()`` returns and resets
    ``{hook: [calls, seconds]}``: the connector's own per-step cost, beside the step times.
    With ``profile`` set, cProfile also runs inside the hooks (one profiler per thread, nothing
    outside a hook): ``take_profile()`` names where their time goes (the timings then include
    cProfile's own overhead, so compare shares, not the totals). With ``annotate`` set, each
    hook call is a ``mcv:<hook>`` range in a running torch profiler's trace."""

    HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
             "request_finished", "update_connector_output", "take_events", "get_kv_connector_stats",
             "bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
             "get_block_ids_with_load_errors", "get_kv_connector_kv_cache_events",
             "handle_preemptions", "clear_connector_metadata")

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self.profile = False
        self.annotate = False
        self._profilers: dict[int, cProfile.Profile] = {}

    def install(self, cls: type) -> None:
        for name in self.HOOKS:
            fn = cls.__dict__.get(name) or getattr(cls, name, None)
            if fn is None or getattr(fn, "_hook_timed", False):
                continue
            setattr(cls, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            prof = self._profiler() if self.profile else None
            t0 = time.perf_counter()
            try:
                if self.annotate:
                    import torch

                    with torch.profiler.record_function(f"mcv:{name}"):
                        return fn(*args, **kwargs)
                if prof is None:
                    return fn(*args, **kwargs)
                return prof.runcall(fn, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    row = self.totals.setdefault(name, [0, 0.0])
                    row[0] += 1
                    row[1] += dt
        timed._hook_timed = True  # type: ignore[attr-defined]
        return timed

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            out, self.totals = self.totals, {}
        return out

    def _profiler(self) -> cProfile.Profile:
        ident = threading.get_ident()
        with self._lock:
            prof = self._profilers.get(ident)
            if prof is None:
                prof = self._profilers[ident] = cProfile.Profile()
        return prof

    def take_profile(self, top: int = 40) -> str:
        """The hooks' profile since the last call, by own time (every thread's), then reset."""
        with self._lock:
            profilers, self._profilers = list(self._profilers.values()), {}
        if not profilers:
            return ""
        buf = io.StringIO()
        stats = pstats.Stats(profilers[0], stream=buf)
        for prof in profilers[1:]:
            stats.add(prof)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        return buf.getvalue()


#: mixed reps profiled by :func:`pyspy_record`: rep -> py-spy options (rep 1: whoever holds the
#: GIL; rep 2: every thread on a CPU, native frames included (py-spy must pause the process for
#: those, so fewer samples): a thread spinning in the driver)
PYSPY_REPS = {1: ["--gil", "--nonblocking", "-r", "200"], 2: ["--native", "-r", "50"]}


def pyspy_record(pyspy: str, pid: int, rep: int, seconds: int, out: Path) -> subprocess.Popen[bytes] | None:
    """Sample process ``pid`` (and its children) for ``seconds`` with py-spy, raw stacks per
    thread into ``out``, if ``rep`` is one of :data:`PYSPY_REPS`; the running py-spy."""
    if rep not in PYSPY_REPS:
        return None
    with open(f"{out}.log", "wb") as log:
        return subprocess.Popen([pyspy, "record", "--pid", str(pid), "--subprocesses", "--threads",
                                 "-d", str(seconds), "-f", "raw", "-o", str(out), *PYSPY_REPS[rep]],
                                stdout=subprocess.DEVNULL, stderr=log)


def other_build_env(site: str) -> dict[str, str]:
    """Environment of an engine that runs another build of this package (an A/B of a change):
    ``site`` is a directory it was installed into (``pip install --no-deps --target``)."""
    if not site or not Path(site, "mooncake_vllm").is_dir():
        raise SystemExit(f"--prev-site {site!r}: no mooncake_vllm package installed there")
    return {"PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}


def pct(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def itl_stats(itls: list[float]) -> dict[str, Any]:
    return {"p50": pct(itls, 0.5), "p99": pct(itls, 0.99), "max": max(itls, default=None),
            "n": len(itls)}


def closed_loop_stats(reqs: list[Req]) -> dict[str, Any]:
    """Output tokens/s over the whole run, TTFT p50/p99, ITL p99 (mixed serving)."""
    start, end = min(r.t_add for r in reqs), max(r.times[-1] for r in reqs)
    ttfts = [r.ttft() for r in reqs]
    return {"throughput_tok_s": sum(len(r.tokens) for r in reqs) / (end - start),
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
            "itl_p99_s": pct([x for r in reqs for x in r.itls()], 0.99), "wall_s": end - start}


def interference(engine: Any, alone: Req, stream: Req, load: Req, after: int,
                 between: Callable[[], Any] = lambda: None, detokenize: bool = True) -> dict[str, Any]:
    """``alone`` decodes by itself; then ``stream`` decodes and ``load`` arrives after ``after`` tokens.

    ITL stats of both streams past their first ``after`` tokens, and of ``stream`` while
    ``load`` is served (from adding it to its first token). ``between`` runs between the two.
    """
    serve(engine, [alone], detokenize=detokenize)
    between()
    serve(engine, [stream], inject=(after, load), detokenize=detokenize)
    t0, t1 = load.t_add, load.times[0]
    during = [b - a for a, b in zip(stream.times, stream.times[1:]) if b > t0 and a < t1]
    return {"alone": itl_stats(alone.itls()[after:]), "during_load": itl_stats(during),
            "whole_stream": itl_stats(stream.itls()[after:]), "load_ttft_s": load.ttft()}


class EngineProcess:
    """One engine in its own process: ``argv + [spec file]``; commands on stdin, results as files.

    The process writes ``<work>/<name>/ready`` once built and ``<command>.json`` per command
    line; ``close`` ends its stdin (and kills it 30 s later if it is still there).
    """

    def __init__(self, name: str, argv: list[str], spec: dict[str, Any], work: Path,
                 env: dict[str, str]) -> None:
        self.name, self.dir = name, work / name
        self.dir.mkdir()
        spec_path = work / f"{name}.spec.json"
        spec_path.write_text(json.dumps({**spec, "dir": str(self.dir)}))
        self.log = work / f"{name}.log"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen([*argv, str(spec_path)], stdin=subprocess.PIPE, stdout=fh,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         text=True)

    def wait_file(self, name: str, timeout: float) -> Any:
        path, deadline = self.dir / name, time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = "exited" if self.proc.poll() is not None else "timed out"
                raise RuntimeError(f"{self.name} {why}; log tail:\n"
                                   + self.log.read_text(errors="replace")[-2500:])
            time.sleep(0.05)
        return json.loads(path.read_text())

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def run(self, command: str, timeout: float) -> Any:
        self.send(command)
        return self.wait_file(f"{command}.json", timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except OSError:
                pass
            threading.Timer(30.0, lambda: self.proc.poll() is None and self.proc.kill()).start()
