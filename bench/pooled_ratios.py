"""Mixed serving against no connector, pooled over several runs of bench_gpu_interference.py.

One run's eight paired reps (each mode's throughput over none's in the same rep) resolve a few
percent on a steady machine and nothing on a noisy one (the H100 starts of 2026-12-06 15:42:
none's reps spread ±25 %). Runs of the same code add up: per mode, the median of every paired
ratio of every run, with a distribution-free confidence interval for that median (order
statistics of the sign test: no assumption on how the noise is shaped), and per run how far
none's own reps spread.

    python3 bench/pooled_ratios.py run1.json run2.json ... [--conf 0.9] [--json out.json]

Each file is the driver's JSON (``table.<mode>.mixed.throughput_by_rep``, with ``none``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from math import comb
from pathlib import Path
from typing import Any

from interference_table import paired_by_rep

__all__ = ["median_interval", "paired_ratios", "pool", "main"]


def median_interval(values: Sequence[float], conf: float = 0.9) -> tuple[float, float] | None:
    """An interval holding the median with probability at least ``conf`` (for any continuous
    distribution): ``(x_(k), x_(n+1-k))`` of the sorted values, ``k`` the largest with
    ``P(Binomial(n, 1/2) < k) <= (1 - conf) / 2``; ``None`` when ``n`` is too small for it."""
    if not 0 < conf < 1:
        raise ValueError(f"conf must lie in (0, 1), found {conf}")
    xs, n = sorted(values), len(values)
    tail, below, k = (1 - conf) / 2, 0.0, 0
    while k < n and below + comb(n, k) / 2 ** n <= tail:
        below += comb(n, k) / 2 ** n
        k += 1
    return (xs[k - 1], xs[n - k]) if k >= 1 else None


def paired_ratios(table: dict[str, Any]) -> dict[str, list[float]]:
    """Per mode but none: its throughput over none's in each rep both ran."""
    none = (table.get("none") or {}).get("mixed", {})
    out: dict[str, list[float]] = {}
    for mode, row in table.items():
        if mode == "none" or not isinstance(row, dict) or "mixed" not in row:
            continue
        ratios = list(paired_by_rep(row["mixed"], none).values())
        if ratios:
            out[mode] = ratios
    return out


def _spread(table: dict[str, Any]) -> tuple[float, float] | None:
    """How far none's reps lie from their median (fractions: below, above)."""
    reps = list(((table.get("none") or {}).get("mixed", {}).get("throughput_by_rep") or {}).values())
    if not reps:
        return None
    mid = statistics.median(reps)
    return min(reps) / mid - 1, max(reps) / mid - 1


def pool(tables: dict[str, dict[str, Any]], conf: float = 0.9) -> dict[str, Any]:
    """``{"runs": {name: {"none_spread": ..., mode: paired median}}, "pooled": {mode: {...}}}``."""
    runs: dict[str, Any] = {}
    pooled: dict[str, list[float]] = {}
    for name, table in tables.items():
        ratios = paired_ratios(table)
        spread = _spread(table)
        runs[name] = {"none_spread": [round(x, 3) for x in spread] if spread else None,
                      **{m: round(statistics.median(r), 3) for m, r in ratios.items()}}
        for mode, r in ratios.items():
            pooled.setdefault(mode, []).extend(r)
    summary: dict[str, Any] = {}
    for mode, ratios in pooled.items():
        interval = median_interval(ratios, conf)
        summary[mode] = {"pairs": len(ratios), "median": round(statistics.median(ratios), 3),
                         "interval": [round(x, 3) for x in interval] if interval else None,
                         "conf": conf}
    return {"runs": runs, "pooled": summary}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--conf", type=float, default=0.9)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    tables = {p.name: json.loads(p.read_text())["table"] for p in args.runs}
    out = pool(tables, args.conf)
    for name, run in out["runs"].items():
        print(f"{name}: none's reps {run['none_spread']}; " + ", ".join(
            f"{m} {v}" for m, v in run.items() if m != "none_spread"))
    for mode, s in sorted(out["pooled"].items()):
        print(f"pooled {mode}: median {s['median']} over {s['pairs']} pairs, "
              f"{s['conf']:.0%} interval {s['interval']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
