"""Compare two routing policies over many bench_routing.py runs, from their request logs.

Per run (one JSON of ``bench/bench_routing.py``; a policy's repeats ``NAME#k`` pooled by their
median): TTFT p50, TTFT mean, TTFT p99 and requests/s of each policy, and in how many runs the second
policy was better on each. Then, over every run, the later turns' TTFT by the requests already
in flight on the instance they were sent to (0, 1, 2, 3, 4 or more), per policy: a closed
loop's p50 favours a policy that leaves some instances idle while others queue, which the
mean and the p99 do not (issue 29). Last, the same split by whether another instance had nothing
in flight at the pick: on a box whose instances share its cores, an idle instance leaves its
share to the others, so skew also speeds up the turns it does not starve::

    python3 bench/routing_table.py docs/bench-results/bench_routing-2026-12-05-*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["by_load_at_pick", "load_at_pick", "main", "per_run"]


def _policy(run_name: str) -> str:
    """The policy of a run named ``policy`` or ``policy#N`` (its N-th repeat)."""
    return run_name.split("#")[0]


def _logs(reports: list[dict[str, Any]], policy: str) -> list[list[dict[str, Any]]]:
    """The request log of every run of ``policy`` (one list per run: their clocks differ)."""
    return [run.get("request_log") or [] for report in reports for name, run in report["runs"].items()
            if _policy(name) == policy]


def _ttfts(run: dict[str, Any]) -> list[float]:
    return [r["ttft_s"] for r in run.get("request_log") or () if r["ttft_s"] is not None]


#: what :func:`per_run` reports per policy, in order; lower is better but for requests/s
COLUMNS = ("TTFT p50", "TTFT mean", "TTFT p99", "req/s")


def per_run(report: dict[str, Any], policies: tuple[str, str]) -> dict[str, tuple[float, ...]] | None:
    """``policy -> (TTFT p50, TTFT mean, TTFT p99, requests/s)``, medians over its repeats; None
    if either policy is missing or has no request log."""
    groups: dict[str, list[tuple[float, ...]]] = {}
    for name, run in report["runs"].items():
        ttfts = _ttfts(run)
        if ttfts:
            groups.setdefault(_policy(name), []).append(
                (statistics.median(ttfts), statistics.fmean(ttfts), run["ttft_p99_s"], run["requests_per_s"]))
    if not all(p in groups for p in policies):
        return None
    return {p: tuple(statistics.median(v[i] for v in groups[p]) for i in range(len(COLUMNS))) for p in policies}


def load_at_pick(log: Iterable[dict[str, Any]], *, idle_elsewhere: bool = False) -> dict[Any, tuple[int, float]]:
    """``in flight at pick (4 = 4+) -> (later turns, their median TTFT)`` of a request log
    (``bench_routing``'s ``request_log`` entries); with ``idle_elsewhere`` keyed by
    ``(in flight, whether another instance had none in flight)``."""
    got: dict[Any, list[float]] = {}
    for r in log:
        if r["turn"] > 0 and r["instance"] is not None and r["ttft_s"] is not None:
            loads, mine = r["loads"], r["instance"]
            n = min(loads[mine] or 0, 4)
            key: Any = (n, any(not k for i, k in enumerate(loads) if i != mine)) if idle_elsewhere else n
            got.setdefault(key, []).append(r["ttft_s"])
    return {k: (len(v), statistics.median(v)) for k, v in sorted(got.items())}


def phases_at_pick(logs: Iterable[list[dict[str, Any]]]) -> dict[tuple[int, int], tuple[int, float]]:
    """``(prefilling, decoding) on its instance at its pick (2 = 2+, 3 = 3+) -> (later turns,
    their median TTFT)`` over request logs of one run each (their clocks differ): what was in
    flight, from the send, first-token and last-token times (``latency_s``; entries without it
    are left out)."""
    got: dict[tuple[int, int], list[float]] = {}
    for log in logs:
        _phases_of_run(log, got)
    return {k: (len(v), statistics.median(v)) for k, v in sorted(got.items())}


def _phases_of_run(log: list[dict[str, Any]], got: dict[tuple[int, int], list[float]]) -> None:
    timed = [r for r in log if r.get("latency_s") is not None and r["ttft_s"] is not None
             and r["instance"] is not None]
    for r in timed:
        if r["turn"] == 0:
            continue
        t = r["sent_s"] + (r.get("pick_s") or 0.0)
        on = [o for o in timed if o is not r and o["instance"] == r["instance"] and o["sent_s"] <= t]
        prefilling = sum(t < o["sent_s"] + o["ttft_s"] for o in on)
        decoding = sum(o["sent_s"] + o["ttft_s"] <= t < o["sent_s"] + o["latency_s"] for o in on)
        got.setdefault((min(prefilling, 2), min(decoding, 3)), []).append(r["ttft_s"])


def by_load_at_pick(reports: list[dict[str, Any]], policy: str, *,
                    idle_elsewhere: bool = False) -> dict[Any, tuple[int, float]]:
    """:func:`load_at_pick` over every run of ``policy`` (its repeats pooled)."""
    return load_at_pick((r for log in _logs(reports, policy) for r in log), idle_elsewhere=idle_elsewhere)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--policies", default="prefix,kv_aware", help="two policies: the reference first")
    args = ap.parse_args(argv)
    a, b = args.policies.split(",")
    reports = [json.loads(f.read_text()) for f in args.files]
    print(f"{'run':<40}" + "".join(f"{c + ' ' + p:>20}" for c in COLUMNS for p in (a, b)))
    better = [0] * len(COLUMNS)
    rows = 0
    for f, report in zip(args.files, reports):
        row = per_run(report, (a, b))
        if row is None:
            continue
        rows += 1
        for i, column in enumerate(COLUMNS):
            better[i] += row[b][i] > row[a][i] if column == "req/s" else row[b][i] < row[a][i]
        print(f"{f.stem:<40}" + "".join(f"{row[p][i]:>20.3f}" for i in range(len(COLUMNS)) for p in (a, b)))
    print(f"{b} better than {a} in {rows} runs: "
          + ", ".join(f"{column} {n}" for column, n in zip(COLUMNS, better)))
    for policy in (a, b):
        cells = ", ".join(f"{n}{'+' if n == 4 else ''}: {k} turns {m:.3f} s"
                          for n, (k, m) in by_load_at_pick(reports, policy).items())
        print(f"{policy} later turns by in-flight at pick: {cells}")
    for policy in (a, b):
        split = by_load_at_pick(reports, policy, idle_elsewhere=True)
        cells = ", ".join(f"{n}{'+' if n == 4 else ''}: {k} turns {m:.3f} s / {split[n, False][0]} turns "
                          f"{split[n, False][1]:.3f} s" for (n, idle), (k, m) in split.items()
                          if idle and (n, False) in split)
        print(f"{policy} later turns by in-flight at pick, another instance idle / none idle: {cells}")
    for policy in (a, b):
        phases = phases_at_pick(_logs(reports, policy))  # logs since 2026-12-06 have latency_s
        if phases:
            print(f"{policy} later turns by prefilling+decoding on their instance at pick: " + ", ".join(
                f"p{p}d{d}: {k} turns {m:.3f} s" for (p, d), (k, m) in phases.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
