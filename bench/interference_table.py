"""The summary table of bench_gpu_interference.py: per mode, and the ratios the issues ask for."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["derive", "paired_by_rep"]


def _reference(report: dict[str, Any]) -> dict[str, Any] | None:
    """The recompute's output: the ours writer's (a fresh process computing every prompt)."""
    for w in ("ours", "intree"):
        tokens = report["writers"].get(w, {}).get("write", {}).get("tokens")
        if tokens:
            return tokens
    return None


def derive(report: dict[str, Any]) -> dict[str, Any]:
    runs, ref = report["runs"], _reference(report)
    hbm = runs.get("none", {}).get("measure")
    hbm = hbm if hbm and "error" not in hbm else None
    table: dict[str, Any] = {}
    for mode, r in runs.items():
        row = _measure_columns(r.get("measure"), ref, hbm)
        _serving_columns(row, r)  # a mixed phase run alone has no measure columns
        if row:
            table[mode] = row
    _serving_ratios(table)
    toks = [report["writers"].get(w, {}).get("write", {}).get("tokens") for w in ("ours", "intree")]
    if all(toks):
        table["writers_tokens_agree"] = toks[0] == toks[1]
    if "ours" in table and "ours-sync" in table:
        table["ours_over_sync_hit_ttft"] = {
            n: sum(table["ours"][f"hit{n}_ttft_ms"]) / sum(table["ours-sync"][f"hit{n}_ttft_ms"])
            for n in runs["ours"]["measure"]["hits"]}
    return table


def _measure_columns(m: dict[str, Any] | None, ref: dict[str, Any] | None,
                     hbm: dict[str, Any] | None) -> dict[str, Any]:
    """The measure phase's columns: a decode stream's ITL alone / during a load, hit TTFTs and
    whether their tokens equal the recompute's and the in-HBM hit's ({} without the phase)."""
    if not m or "error" in m:
        return {}
    a, d = m["alone"], m["during_load"]
    if a["p50"] is None:  # a stream shorter than its warm-up tokens (a dry run)
        return {}
    row: dict[str, Any] = {
        "alone_ms": [a["p50"] * 1e3, a["p99"] * 1e3, a["max"] * 1e3],
        "during_ms": [d["p50"] * 1e3, d["p99"] * 1e3, d["max"] * 1e3] if d["n"] else None,
        "p99_ratio": d["p99"] / a["p99"] if d["n"] else None, "during_n": d["n"],
        "load_ttft_ms": m["load"]["ttft_s"] * 1e3, "load_cached": m["load"]["cached"],
        "load_tokens_equal_recompute": (m["load"]["tokens"] == ref["load"]) if ref else None}
    for n, reps in m["hits"].items():
        row[f"hit{n}_ttft_ms"] = [x["ttft_s"] * 1e3 for x in reps]
        row[f"hit{n}_cached"] = [x["cached"] for x in reps]
        if ref and n in ref["hits"]:  # the in-tree writer writes no hit past --intree-max-len
            row[f"hit{n}_tokens_equal_recompute"] = [x["tokens"] == y
                                                     for x, y in zip(reps, ref["hits"][n])]
        if hbm:  # the same prompt recomputed, then an in-HBM prefix hit: the same compute path
            row[f"hit{n}_tokens_equal_inhbm_hit"] = [x["tokens"] == y["again_tokens"]
                                                     for x, y in zip(reps, hbm["hits"][n])]
    return row


def _serving_columns(row: dict[str, Any], run: dict[str, Any]) -> None:
    """Mixed serving and miss TTFT (ms, medians over each length's prompts)."""
    reps = [m for m in run.get("mixed_reps", [run.get("mixed")])
            if m and "error" not in m and not m.get("profiled")]  # py-spy slowed those
    misses = run.get("misses")
    if reps:
        row["mixed"] = _mixed_row(reps)
    if misses and "error" not in misses:
        row["miss_ttft_ms"] = {n: statistics.median(m["ttft_s"]) * 1e3
                               for n, m in misses.items() if n.isdigit()}  # lengths, not "connector"/"advisor"
        counters = misses.get("connector") or {}
        row["copy_fences"] = [counters.get("worker_copy_fences"),
                              counters.get("worker_copy_fences_waited")]


def _mixed_row(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Mixed serving over its reps: throughput pooled (all tokens / all wall time), latency
    percentiles the median of the reps', and the connector hooks' share of the engine steps."""
    wall = sum(m["wall_s"] for m in reps)
    row: dict[str, Any] = {
        "throughput_tok_s": sum(m["throughput_tok_s"] * m["wall_s"] for m in reps) / wall,
        "ttft_p50_ms": statistics.median(m["ttft_p50_s"] for m in reps) * 1e3,
        "ttft_p99_ms": statistics.median(m["ttft_p99_s"] for m in reps) * 1e3,
        "itl_p99_ms": statistics.median(m["itl_p99_s"] for m in reps) * 1e3,
        "reps": len(reps), "throughput_per_rep": [round(m["throughput_tok_s"], 1) for m in reps],
        "throughput_by_rep": {str(m["rep"]): m["throughput_tok_s"] for m in reps if "rep" in m}}
    ttft_steps = [n for m in reps for n in m.get("ttft_steps", ()) if n >= 0]
    if ttft_steps:  # where a longer TTFT comes from: more engine steps before the first token, or longer ones
        row["ttft_steps_mean"] = statistics.fmean(ttft_steps)
        row["ttft_steps_count"] = {str(k): ttft_steps.count(k) for k in sorted(set(ttft_steps))}
    delta: dict[str, int] = {}
    for m in reps:
        for name, value in (m.get("connector_delta") or {}).items():
            delta[name] = delta.get(name, 0) + value
    if delta:
        row["connector_delta"] = delta
    steps = [m["steps"] for m in reps if m.get("steps")]
    if steps:
        n, total = sum(s["n"] for s in steps), sum(s["sum_s"] for s in steps)
        row["step_ms_mean"] = total / max(1, n) * 1e3
        row["step_ms_p99"] = statistics.median(s["p99_s"] for s in steps if s["p99_s"]) * 1e3
        hooks: dict[str, float] = {}
        for m in reps:
            for name, (_, seconds) in (m.get("hooks") or {}).items():
                hooks[name] = hooks.get(name, 0.0) + seconds
        if hooks:
            row["hook_ms_per_step"] = sum(hooks.values()) / max(1, n) * 1e3
            row["hook_ms_per_step_top"] = {k: round(v / max(1, n) * 1e3, 3) for k, v in
                                           sorted(hooks.items(), key=lambda kv: -kv[1])[:5]}
    return row


def _pool_ratios(table: dict[str, Any]) -> None:
    """Issue 24: each ours mode's pool hit TTFT / min(recompute, in-tree hit) per length, and
    its mixed serving against no connector."""
    none, intree = table.get("none", {}), table.get("intree", {})
    for mode, row in list(table.items()):
        if not (isinstance(row, dict) and mode.startswith("ours")):
            continue
        ratios: dict[str, Any] = {}
        for key in (k for k in row if k.startswith("hit") and k.endswith("_ttft_ms")):
            bars = [sum(r[key]) for r in (none, intree) if key in r]
            if bars:
                ratios[key.removesuffix("_ttft_ms")] = round(sum(row[key]) / min(bars), 3)
        if "mixed" in row and "mixed" in none:
            ratios["mixed_throughput_vs_none"] = round(
                row["mixed"]["throughput_tok_s"] / none["mixed"]["throughput_tok_s"], 3)
            ratios["mixed_ttft_p99_vs_none"] = round(
                row["mixed"]["ttft_p99_ms"] / none["mixed"]["ttft_p99_ms"], 3)
            ratios.update(_paired(row["mixed"], none["mixed"]))
        table.setdefault("pool_ratios", {})[mode] = ratios


def paired_by_rep(mode: dict[str, Any], none: dict[str, Any]) -> dict[int, float]:
    """A mode's mixed throughput over none's in each rep both ran (rows' ``mixed``)."""
    a, b = mode.get("throughput_by_rep") or {}, none.get("throughput_by_rep") or {}
    return {int(rep): a[rep] / b[rep] for rep in a if rep in b and b[rep]}


def _paired(mode: dict[str, Any], none: dict[str, Any]) -> dict[str, float]:
    """Throughput / none's in the same rep (the reps interleave modes: a paired ratio cancels
    what drifts over the run), median over the reps both ran and over reps 1+ (rep 0 is each
    process's first burst)."""
    pairs = paired_by_rep(mode, none)
    out: dict[str, float] = {}
    if pairs:
        out["mixed_paired_median_vs_none"] = round(statistics.median(pairs.values()), 3)
    steady = [ratio for rep, ratio in pairs.items() if rep > 0]
    if steady:
        out["mixed_paired_median_vs_none_reps1"] = round(statistics.median(steady), 3)
    return out


def _serving_ratios(table: dict[str, Any]) -> None:
    """Issue 12's targets 3 and 4: ours vs in-tree (mixed), ours vs no connector (misses)."""
    _pool_ratios(table)
    ours, intree, none = table.get("ours", {}), table.get("intree", {}), table.get("none", {})
    if "mixed" in ours and "mixed" in intree:
        o, t = ours["mixed"], intree["mixed"]
        table["mixed_ours_over_intree"] = {"throughput": o["throughput_tok_s"] / t["throughput_tok_s"],
                                           "ttft_p99": o["ttft_p99_ms"] / t["ttft_p99_ms"]}
    if "miss_ttft_ms" in none:
        table["miss_overhead"] = {
            mode: {n: row["miss_ttft_ms"][n] / none["miss_ttft_ms"][n] - 1
                   for n in none["miss_ttft_ms"] if n in row.get("miss_ttft_ms", {})}
            for mode, row in table.items() if isinstance(row, dict) and "miss_ttft_ms" in row
            and mode != "none"}


