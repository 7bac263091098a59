"""The soak's report: hit rate over time, recovery per fault, failures, resources; JSON + PNG.

Recovery of a fault = seconds from its end until the pool's hit rate (over a trailing
``window``) is back to >= 80 % of its level in the ``before`` seconds ahead of the fault
(0 when it never fell below that). Requests are attributed to a fault when they started
between its beginning and 30 s after its end.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["KILLS", "hit_series", "killed_in_flight", "metrics_hit_series", "miss_causes", "recovery", "report",
           "resources", "table", "write"]

TARGET = 0.8  #: of the pre-fault hit rate
DEADLINE = 30.0  #: seconds after a fault's end


def hit_series(samples: list[dict[str, Any]], end: float, window: float = 5.0,
               step: float = 1.0) -> list[tuple[float, float | None]]:
    """(t, pool hits / possible) of the requests started in ``(t - window, t]``."""
    out: list[tuple[float, float | None]] = []
    t = window
    while t <= end:
        rows = [s for s in samples if t - window < s["t"] <= t and not s["failed"]]
        possible = sum(s["possible"] for s in rows)
        out.append((t, sum(s["hit"] for s in rows) / possible if possible else None))
        t += step
    return out


def metrics_hit_series(rows: list[dict[str, Any]], window: float = 10.0) -> list[tuple[float, float | None]]:
    """(t, Δ pool hit tokens / Δ prompt tokens) over a trailing ``window``, summed over instances
    (a restarted instance's counters start again at 0: negative deltas count as 0)."""
    out: list[tuple[float, float | None]] = []
    for i, row in enumerate(rows):
        old = next((r for r in rows[:i] if r["t"] >= row["t"] - window), None)
        if old is None or old is row:
            continue
        hit = prompt = 0.0
        for name, now in row["metrics"].items():
            then = old["metrics"].get(name, {})
            hit += max(0.0, now.get("vllm:mooncake_vllm_hit_tokens_total", 0) -
                       then.get("vllm:mooncake_vllm_hit_tokens_total", 0))
            prompt += max(0.0, now.get("vllm:prompt_tokens_total", 0) - then.get("vllm:prompt_tokens_total", 0))
        out.append((row["t"], hit / prompt if prompt else None))
    return out


def recovery(series: list[tuple[float, float | None]], began: float, ended: float,
             before: float = 30.0) -> dict[str, Any]:
    """Pre-fault level, the lowest rate after the fault began, and seconds to get back to 80 %."""
    pre = [r for t, r in series if began - before <= t < began and r is not None]
    if not pre:
        return {"pre": None, "low": None, "recovery_s": None, "met": None}
    level = statistics.fmean(pre)
    after = [(t, r) for t, r in series if t >= began and r is not None]
    low = min((r for _, r in after if _ <= ended + DEADLINE), default=None)
    back = next((t for t, r in after if t >= ended and r >= TARGET * level), None)
    took = None if back is None else round(max(0.0, back - ended), 1)
    if low is not None and low >= TARGET * level:
        took = 0.0
    return {"pre": round(level, 3), "low": None if low is None else round(low, 3),
            "recovery_s": took, "met": took is not None and took <= DEADLINE}


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _fds_within(level: float, end: float, tolerance: float) -> bool:
    """Open descriptors at the end within ``tolerance`` of their level (at least 2 more allowed)."""
    return end <= max(level * (1 + tolerance), level + 2)


def resources(rows: list[dict[str, Any]], warmup: float, tolerance: float = 0.10,
              allow: dict[str, int] | None = None, window: float = 60.0,
              baseline: str | None = None, baselined: tuple[str, ...] = ()) -> dict[str, Any]:
    """Per service and process (a restart is a new pid): RSS and open fds at their level after
    warm-up — the median over ``window`` s from ``warmup`` s into the soak, or from ``warmup``
    s after a restart (a fresh process opens its connections and touches its memory lazily) —
    at the end (the median over its last ``window`` s) and at most (``peak``). ``within``: the
    end stays within ``tolerance`` of the level (plus ``allow[name]`` bytes of RSS: a holder
    touches its pool segment lazily, up to the segment's size; fds: at least 2 more). Medians,
    not single samples: a socket per request in flight comes and goes with the load, a leak
    stays. ``baselined`` processes (vLLM with our connector) may also grow as much as the
    ``baseline`` process (the same vLLM without a connector, serving the same prompts) did:
    that growth is vLLM's own (``within_baseline``)."""
    out: dict[str, Any] = {}
    names = sorted({n for r in rows for n in r["usage"]})
    for name in names:
        seq = [(r["t"], *r["usage"][name]) for r in rows if name in r["usage"]]
        pids = list(dict.fromkeys(s[3] for s in seq))
        runs = []
        for i, pid in enumerate(pids):
            mine = [s for s in seq if s[3] == pid]
            settled = (warmup if i == 0 else mine[0][0] + warmup)
            mine = [s for s in mine if s[0] >= settled]
            if not mine:
                continue
            first = [s for s in mine if s[0] < mine[0][0] + window]
            last = [s for s in mine if s[0] > mine[-1][0] - window]
            rss0, fd0 = _median([s[1] for s in first]), _median([s[2] for s in first])
            rss1, fd1 = _median([s[1] for s in last]), _median([s[2] for s in last])
            extra = (allow or {}).get(name, 0)
            runs.append({"pid": pid, "rss_mb": [round(rss0 / 2**20, 1), round(rss1 / 2**20, 1)],
                         "fds": [fd0, fd1], "peak": [round(max(s[1] for s in mine) / 2**20, 1),
                                                     max(s[2] for s in mine)],
                         "rss_growth": round(rss1 / rss0 - 1, 3), "seconds": round(mine[-1][0] - mine[0][0]),
                         "within": rss1 <= rss0 * (1 + tolerance) + extra and _fds_within(fd0, fd1, tolerance)})
        if runs:
            out[name] = {**runs[-1], "within": all(r["within"] for r in runs), "processes": runs}
    base = out.get(baseline or "")
    if base is not None:
        allowed = max(tolerance, max(r["rss_growth"] for r in base["processes"]))
        for name in baselined:
            if name in out:
                out[name]["within_baseline"] = out[name]["within"] or all(
                    r["rss_growth"] <= allowed and _fds_within(*r["fds"], tolerance) for r in out[name]["processes"])
    return out


#: faults that SIGKILL a vLLM instance: its requests in flight may fail (counted apart)
KILLS = ("vllm_kill",)


def killed_in_flight(samples: list[dict[str, Any]], faults: list[dict[str, Any]]) -> list[int]:
    """Indices of the failed requests that were in flight when a :data:`KILLS` fault began."""
    kills = [f["began"] for f in faults if f["kind"] in KILLS and f["began"] is not None]
    return [i for i, s in enumerate(samples) if s["failed"] and s.get("seconds") is not None
            and any(s["t"] <= k <= s["t"] + s["seconds"] for k in kills)]


#: pool tokens the claim policy did not claim (load_policy auto: predicted slower than recomputing)
DECLINED = "vllm:mooncake_vllm_declined_tokens_total"


def miss_causes(rows: list[dict[str, Any]], began: float, until: float) -> dict[str, int]:
    """Our connector's misses by cause (``vllm:mooncake_vllm_miss_causes_total``) counted by
    every instance between ``began`` and ``until`` (a restarted instance starts again at 0),
    and the pool tokens its claim policy declined (``declined_tokens``)."""
    out: dict[str, int] = {}
    start = max((i for i, r in enumerate(rows) if r["t"] <= began), default=0)  # the counts as it began
    inside = [r for r in rows[start:] if r["t"] <= until]
    for prev, row in zip(inside, inside[1:]):
        for inst, now in row["metrics"].items():
            then = prev["metrics"].get(inst)
            for key, value in now.items():
                if key == DECLINED:
                    cause = "declined_tokens"
                elif key.startswith("vllm:mooncake_vllm_miss_causes_total{"):
                    cause = key.split("cause=", 1)[1].rstrip("}")
                else:
                    continue
                old = then.get(key, 0.0) if then is not None else value
                step = value - old if value >= old else value
                if step:
                    out[cause] = out.get(cause, 0) + int(step)
    return out


def report(samples: list[dict[str, Any]], faults: list[dict[str, Any]],
           series: list[tuple[float, float | None]], usage_rows: list[dict[str, Any]],
           warmup: float, allow: dict[str, int] | None = None, baseline: str | None = None,
           baselined: tuple[str, ...] = ()) -> dict[str, Any]:
    """The whole result: totals, one row per fault, resources. ``failed`` leaves out the
    requests in flight on an instance that was killed (``killed_in_flight``, counted)."""
    killed = set(killed_in_flight(samples, faults))
    per_fault = []
    for f in faults:
        if f["began"] is None:
            continue
        ended = f["ended"] if f["ended"] is not None else f["began"]
        mine = [(i, s) for i, s in enumerate(samples) if f["began"] <= s["t"] <= ended + DEADLINE]
        per_fault.append({**f, **recovery(series, f["began"], ended),
                          "requests": len(mine), "wrong": sum(s["wrong"] for _, s in mine),
                          "failed": sum(bool(s["failed"]) and i not in killed for i, s in mine),
                          "killed_in_flight": len(killed_in_flight(samples, [f])),
                          "miss_causes": miss_causes(usage_rows, f["began"], ended + DEADLINE)})
    ttfts = sorted(s["ttft"] for s in samples if s.get("ttft") is not None)
    return {
        "requests": len(samples), "wrong": sum(s["wrong"] for s in samples),
        "failed": sum(bool(s["failed"]) and i not in killed for i, s in enumerate(samples)),
        "killed_in_flight": len(killed),
        "failures": sorted({s["failed"][:160] for s in samples if s["failed"]})[:20],
        "ttft_p50": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p99": ttfts[int(len(ttfts) * 0.99)] if ttfts else None,
        "faults": per_fault,
        #: faults the schedule ran out of time for (one that overran pushed them back)
        "skipped": [f"{f['kind']} (due {f['at']} s)" for f in faults if f["began"] is None],
        "resources": resources(usage_rows, warmup, allow=allow, baseline=baseline, baselined=baselined),
    }


def table(result: dict[str, Any]) -> str:
    """The per-fault table (markdown)."""
    lines = ["| fault | began s | lasted s | pre hit | low | recovery s | ≤30 s | requests | wrong | failed "
             "| killed in flight | misses by cause |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in result["faults"]:
        lasted = None if f["ended"] is None else round(f["ended"] - f["began"], 1)
        causes = ", ".join(f"{k} {v}" for k, v in sorted((f.get("miss_causes") or {}).items())) or "-"
        lines.append(f"| {f['kind']} | {f['began']:.0f} | {lasted} | {f['pre']} | {f['low']} | "
                     f"{f['recovery_s']} | {f['met']} | {f['requests']} | {f['wrong']} | {f['failed']} | "
                     f"{f.get('killed_in_flight', 0)} | {causes} |")
    return "\n".join(lines)


def write(result: dict[str, Any], samples: list[dict[str, Any]], series: list[tuple[float, float | None]],
          out: Path) -> None:
    """``out``.json (result + raw samples) and ``out``.png (hit rate, latency, faults shaded)."""
    out.with_suffix(".json").write_text(json.dumps({**result, "series": series, "samples": samples}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the PNG is optional
        return
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    ax1.plot([t for t, _ in series], [r if r is not None else float("nan") for _, r in series], lw=1)
    ax1.set_ylabel("pool hit rate")
    ax1.set_ylim(-0.05, 1.05)
    key = "ttft" if any(s.get("ttft") for s in samples) else "seconds"
    bins: dict[int, list[float]] = {}
    for s in samples:
        if s.get(key) is not None and not s["failed"]:
            bins.setdefault(int(s["t"] // 10), []).append(s[key])
    xs = sorted(bins)
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        ax2.plot([10 * x + 5 for x in xs], [sorted(bins[x])[int(q * (len(bins[x]) - 1))] for x in xs],
                 label=f"{key} {label}")
    ax2.set_ylabel("seconds")
    ax2.set_yscale("log")
    ax2.legend()
    ax2.set_xlabel("seconds since the load started")
    for f in result["faults"]:
        end = f["ended"] if f["ended"] is not None else f["began"]
        for ax in (ax1, ax2):
            ax.axvspan(f["began"], max(end, f["began"] + 0.5), color="red", alpha=0.15)
        ax1.text(f["began"], 1.0, f["kind"], rotation=90, fontsize=7, va="top")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=90)
    plt.close(fig)
