"""Read the torch.profiler traces of bench_gpu_interference.py's ``--timeline-modes``: per mode,
where the engine steps' time went, steps that gave some request its first token apart.

    python3 bench/timeline_table.py interference.json [--json out.json]

For each mode with a ``timeline`` run (its trace ``timeline-MODE.json.gz`` beside the JSON):
every ``ProfilerStep#N`` (engine step N) is classed by whether a request got its first token
in it; per class the mean of the step's wall time, of vLLM's scopes and our hooks on the
engine thread (``VLLM_CUSTOM_SCOPES_FOR_PROFILING``, ``mcv:<hook>``), of GPU busy time per
stream (vLLM's stream: the one with the most kernel time) and of the device-to-host copies on
vLLM's stream (its sampled tokens' way to the host), plus the CUDA runtime calls each thread
made in the window (our save and load threads included: CUPTI sees every thread).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["main", "summarize"]

#: engine-thread scopes reported (vLLM's, with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1)
SCOPES = ("gpu_model_runner: preprocess", "gpu_model_runner: forward", "gpu_model_runner: postprocess",
          "gpu_model_runner: sample", "gpu_model_runner: bookkeep", "llm_engine step: get_output",
          "llm_engine step: process_outputs")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(spans: Iterable[tuple[float, float]]) -> float:
    """Length covered by ``(start, end)`` spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _clip(a: float, b: float, lo: float, hi: float) -> tuple[float, float] | None:
    a, b = max(a, lo), min(b, hi)
    return (a, b) if b > a else None


def summarize(events: list[dict[str, Any]], first_steps: Iterable[int]) -> dict[str, Any]:
    """The trace's steps, classed by whether some request's first token came in them (ms)."""
    steps = sorted((int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"], e["tid"])
                   for e in events if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#"))
    if not steps:
        return {"error": "no ProfilerStep ranges in the trace"}
    engine_tid = steps[0][3]
    firsts = set(first_steps)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATS]
    by_stream: dict[Any, float] = defaultdict(float)
    for e in gpu:
        if e["cat"] == "kernel":
            by_stream[e.get("args", {}).get("stream")] += e["dur"]
    vllm_stream = max(by_stream, key=lambda s: by_stream[s]) if by_stream else None
    ranges = [e for e in events if e.get("ph") == "X" and e.get("tid") == engine_tid
              and e.get("cat") == "user_annotation"
              and (e["name"] in SCOPES or e["name"].startswith("mcv:"))]
    rows: dict[str, list[dict[str, float]]] = {"first_token": [], "other": []}
    for n, t0, t1, _tid in steps:
        row: dict[str, float] = {"step": (t1 - t0) / 1e3}
        for e in ranges:
            if t0 <= e["ts"] < t1:
                key = "mcv hooks" if e["name"].startswith("mcv:") else e["name"]
                row[key] = row.get(key, 0.0) + e["dur"] / 1e3
                if e["name"].startswith("mcv:"):
                    row[e["name"]] = row.get(e["name"], 0.0) + e["dur"] / 1e3
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for e in gpu:
            span = _clip(e["ts"], e["ts"] + e["dur"], t0, t1)
            if span is None:
                continue
            stream = "gpu vllm stream" if e.get("args", {}).get("stream") == vllm_stream else "gpu other streams"
            spans[stream].append(span)
            if e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]:
                spans[f"{'vllm' if stream == 'gpu vllm stream' else 'other'} DtoH"].append(span)
        for key, s in spans.items():
            row[key] = _union(s) / 1e3
        rows["first_token" if n in firsts else "other"].append(row)
    out: dict[str, Any] = {"vllm_stream": vllm_stream, "steps": len(steps)}
    for cls, rs in rows.items():
        keys = sorted({k for r in rs for k in r})
        out[cls] = {"n": len(rs), **{k: round(statistics.fmean(r.get(k, 0.0) for r in rs), 3)
                                     for k in keys}} if rs else {"n": 0}
    runtime: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            who = "engine" if e.get("tid") == engine_tid else f"tid {e.get('tid')}"
            cell = runtime[who][e["name"]]
            cell[0] += 1
            cell[1] += e["dur"] / 1e3
    out["cuda_calls_ms"] = {who: dict(sorted(((k, [v[0], round(v[1], 2)]) for k, v in calls.items()),
                                             key=lambda kv: -kv[1][1])[:8])
                            for who, calls in runtime.items()}
    return out


def _load(trace: Path) -> list[dict[str, Any]]:
    with gzip.open(trace, "rt") as f:
        return list(json.load(f)["traceEvents"])


def _table(summary: dict[str, dict[str, Any]]) -> str:
    lines = []
    for cls in ("first_token", "other"):
        keys = sorted({k for s in summary.values() for k in s.get(cls, {}) if k != "n"},
                      key=lambda k: (k.startswith("mcv:"), k))
        modes = list(summary)
        lines.append(f"\n{cls} steps (mean ms)   " + "  ".join(f"{m:>12}" for m in modes))
        lines.append("n".ljust(36) + "  ".join(f"{summary[m].get(cls, {}).get('n', 0):>12}" for m in modes))
        for k in keys:
            lines.append(k[:36].ljust(36) + "  ".join(
                f"{summary[m].get(cls, {}).get(k, 0.0):>12.3f}" for m in modes))
    for m, s in summary.items():
        lines.append(f"\n{m}: CUDA calls in the window (count, ms) by thread")
        for who, calls in s.get("cuda_calls_ms", {}).items():
            lines.append(f"  {who}: " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in calls.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="bench_gpu_interference.py's JSON (traces beside it)")
    ap.add_argument("--json", default="", help="also write the summary here")
    args = ap.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    summary: dict[str, dict[str, Any]] = {}
    for mode, run in report.get("runs", {}).items():
        tl = run.get("timeline") or {}
        if not tl.get("trace"):
            continue
        trace = Path(args.report).with_name(tl["trace"])
        if not trace.exists():
            summary[mode] = {"error": f"{trace.name} missing"}
            continue
        summary[mode] = summarize(_load(trace), tl.get("first_step", []))
    if not summary:
        print("no timeline runs in the report", file=sys.stderr)
        return 1
    print(_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
