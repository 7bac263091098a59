"""Issue 24's figures from bench_gpu_interference.py JSON: hit TTFT per mode and length, and
the degraded-pool timeline (TTFT per request, tokens from the pool, the faults marked), or
without a degraded phase the mixed-serving throughput of every rep per mode.

    .venv/bin/python bench/plot_pool.py docs/gpu-results/interference-....json out.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "plot"]


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    table, runs = report["table"], report["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    modes = [m for m in runs if m in table]
    lengths = sorted({k[3:-8] for m in modes for k in table[m]
                      if k.startswith("hit") and k.endswith("_ttft_ms")}, key=int)
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        ys = [sum(v) / len(v) if (v := table[mode].get(f"hit{n}_ttft_ms")) else 0.0
              for n in lengths]  # 0: not measured in this mode (in-tree stops at 16k)
        ax1.bar([j + i * width for j in range(len(lengths))], ys, width,
                label=mode if mode != "none" else "none (recompute)")
    ax1.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(lengths))], lengths)
    ax1.set_xlabel("prompt tokens (a fresh instance after the writer)")
    ax1.set_ylabel("TTFT, ms (mean of the reps)")
    ax1.set_title("pool hit vs recompute")
    ax1.legend()
    degraded = next(((m, r) for m, r in runs.items() if r.get("degraded")), None)
    if degraded:
        mode, run = degraded
        reqs = run["degraded"]["requests"]
        ax2.plot([q["t"] for q in reqs], [q["ttft_s"] * 1e3 for q in reqs], ".-", lw=0.6,
                 label=f"{mode}: TTFT")
        pool = [q for q in reqs if q["cached"] > 0]
        ax2.plot([q["t"] for q in pool], [q["ttft_s"] * 1e3 for q in pool], "o", ms=4,
                 mfc="none", label="served from the pool")
        events = {e["what"]: e["t"] for e in run.get("faults", []) if "what" in e}
        if "SIGSTOP" in events:
            ax2.axvspan(events["SIGSTOP"], events.get("SIGCONT", reqs[-1]["t"]), alpha=0.15,
                        color="red", label="holders 2-4 SIGSTOPped")
        ax2.set_yscale("log")
        ax2.set_xlabel("seconds")
        ax2.set_ylabel("TTFT, ms")
        ax2.set_title(f"degraded pool, {reqs[0]['n']}-token hits one after another")
        ax2.legend(fontsize=8)
    else:  # no degraded phase: mixed serving per rep (reps interleaved across modes)
        for mode in modes:
            reps = (table[mode].get("mixed") or {}).get("throughput_per_rep") or []
            ax2.plot(range(1, len(reps) + 1), reps, "o-", label=mode)
        ax2.set_xlabel("mixed rep (modes interleaved ABC CBA ...)")
        ax2.set_ylabel("output tok/s")
        ax2.set_title("mixed serving, closed loop")
        ax2.legend(fontsize=8)
    fig.suptitle(f"{report.get('started', '')}: " + ", ".join(
        f"{m}" for m in modes), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__)
        return 2
    plot(json.loads(Path(args[0]).read_text()), Path(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
