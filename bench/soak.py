"""A fleet under faults: a bounded soak with injected failures across simulated hosts.

    .venv/bin/python bench/soak.py [--minutes 15] [--clients 4] [--faults all] [--repeat 2]
                                   [--store-only] [--loopback] [--out bench-results/soak]

The fleet (``soak_fleet``): mooncake_master, our embedded metadata server and two holders,
each on its own simulated host (a network namespace on a bridge, ``soak_net``: subnet
10.231.7.0/24, names ``mvsoak-*``); unless ``--store-only``, two kv_both vLLM CPU instances
behind ``mooncake-vllm proxy --flow kv_both`` and a kv_producer/kv_consumer pair behind a
second proxy's store flow, each instance on its own host, plus a no-connector reference
instance. The load (``soak_load``): closed-loop clients, every answer checked against the
reference. The faults (``soak_faults``): on a schedule printed at start. The result
(``soak_report``): JSON + PNG, and a table per fault on stdout. Where namespaces cannot
be made (or ``--loopback``) the same fleet runs on 127.0.0.1 and the result says so
(a link cut is then a SIGSTOP of the holder).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_faults import KINDS, SETTLE, FaultRunner, schedule  # noqa: E402
from soak_fleet import Fleet  # noqa: E402
from soak_load import HttpLoad, Sampler, StoreLoad  # noqa: E402
from soak_net import Net, namespaces_available  # noqa: E402
from soak_report import DEADLINE, hit_series, metrics_hit_series, report, table, write  # noqa: E402

__all__ = ["STORE_FAULTS", "VLLM_BASELINE", "main", "rebuild", "run"]

log = logging.getLogger("soak")

#: faults a pool-only fleet can take (no vLLM, no proxy)
STORE_FAULTS = ("holder_kill", "holder_stop", "master_kill", "master_stop", "metadata_restart",
                "link_down", "flood")


#: the no-connector reference serves every prompt too: its growth is vLLM's own
VLLM_BASELINE: dict[str, Any] = {"baseline": "ref", "baselined": ("v1", "v2", "p", "d")}


def rebuild(path: Path, warmup: float, segment_size: int = 32 << 20) -> dict[str, Any]:
    """The report again from a soak's JSON (its samples, faults, series and resource samples)."""
    old = json.loads(path.read_text())
    holders = {n for r in old["sampler"] for n in r["usage"] if n.startswith("h") and n[1:].isdigit()}
    result = report(old["samples"], old["faults"], [tuple(x) for x in old["series"]], old["sampler"], warmup,
                    {h: segment_size for h in holders}, **({} if old["store_only"] else VLLM_BASELINE))
    keep = ("kv_idle", "hosts", "seconds", "clients", "store_only", "load_policy", "sampler", "samples",
            "series")
    result.update({k: old[k] for k in keep if k in old})
    return result


def _documents(n: int, vocab: int, seed: int = 27) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    # 1-2k tokens, leaving room for the question and the answer in --max-model-len 2048
    return [[rng.randrange(10, vocab - 1) for _ in range(rng.randrange(1024, 1984))] for _ in range(n)]


def _vllm_fleet(fleet: Fleet, model: Path, pd: bool = True) -> tuple[dict[str, str], str]:
    """Reference, v1, v2 (kv_both), p (producer), d (consumer), two proxies; started in parallel
    (``pd`` False: no 1P1D pair)."""
    from concurrent.futures import ThreadPoolExecutor

    roles = {"ref": None, "v1": "kv_both", "v2": "kv_both"}
    if pd:
        roles.update(p="kv_producer", d="kv_consumer")
    with ThreadPoolExecutor(len(roles)) as pool:
        for fut in [pool.submit(fleet.start, name, model=model, role=role) for name, role in roles.items()]:
            fut.result()
    name = model.name
    fleet.start_proxy("proxy", name, "kv_both", [], ["v1", "v2"])
    targets = {"kv_both": str(fleet.procs["proxy"].url)}
    if pd:
        fleet.start_proxy("proxy_pd", name, "store", ["p"], ["d"])
        targets["1p1d"] = str(fleet.procs["proxy_pd"].url)
    return targets, str(fleet.procs["ref"].url)


def _kv_idle(metrics: dict[str, str], wait: float = 30.0) -> dict[str, float | None]:
    """Each instance's ``vllm:kv_cache_usage_perc`` once the load has stopped: it must fall to
    0 (no blocks held for us: a save or load that never ended would keep its request's blocks).
    Polled up to ``wait`` s; None where the instance did not answer."""
    from soak_load import scrape

    deadline = time.monotonic() + wait
    while True:
        usage: dict[str, float | None] = {}
        for name, url in metrics.items():
            try:
                usage[name] = scrape(url).get("vllm:kv_cache_usage_perc")
            except Exception:  # noqa: BLE001 - recorded as None
                usage[name] = None
        if all(u == 0.0 for u in usage.values()) or time.monotonic() > deadline:
            return usage
        time.sleep(1.0)


def _refill_lines(workdir: Path) -> dict[str, list[str]]:
    """Each vLLM log's timelines of pool outages (``v1/refill.HbmRefill``: lost at, back at,
    re-save started, chunks re-saved, done); the work directory is removed after the run."""
    out: dict[str, list[str]] = {}
    for path in sorted(workdir.rglob("*.log")):  # a vLLM server logs in its own directory
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()
                 if "pool refill from HBM" in ln]
        if lines:
            out[path.stem] = lines
    return out


def run(workdir: Path, *, seconds: float, clients: int, kinds: list[str], repeat: int = 1,
        store_only: bool = True, loopback: bool = False, warmup: float = 20.0,
        model: Path | None = None, holders: int = 2, segment_size: int = 32 << 20,
        client_ttl: int = 5, pd: bool = True, kv_cache_bytes: int = 8 << 20,
        load_policy: str = "auto") -> dict[str, Any]:
    """One soak; returns the report (also printed/written by :func:`main`)."""
    why = "--loopback" if loopback else namespaces_available()
    net = None if why else Net().up()
    fleet = Fleet(workdir, net, holders=holders, segment_size=segment_size, client_ttl=client_ttl,
                  kv_cache_bytes=kv_cache_bytes, load_policy=load_policy)
    faults = schedule(kinds, seconds, warmup, repeat)
    print(f"soak: {'namespaces on 10.231.7.0/24' if net else f'loopback ({why})'}; "
          f"{seconds:.0f} s, {clients} clients; faults:", flush=True)
    for f in faults:
        print(f"  t+{f.at:>6.1f} s  {f.kind}: {KINDS[f.kind].what}", flush=True)
    old_bind = os.environ.get("MC_TCP_BIND_ADDRESS")
    try:
        fleet.start_pool()
        if net is not None:  # our own pool clients (StoreLoad) reach the hosts from the bridge
            os.environ["MC_TCP_BIND_ADDRESS"] = net.gateway
        if store_only:
            load: Any = StoreLoad(str(fleet.config_path), clients, seconds, flooding=lambda: fleet.flooding)
            metrics: dict[str, str] = {}
        else:
            from mooncake_vllm.demo.tiny_model import VOCAB_SIZE, cached_tiny_model

            model = model or cached_tiny_model()
            targets, ref = _vllm_fleet(fleet, model, pd)
            load = HttpLoad(targets, ref, str(model), clients, seconds, vocab=VOCAB_SIZE,
                            documents=_documents(16, VOCAB_SIZE), flooding=lambda: fleet.flooding)
            metrics = {n: str(fleet.procs[n].url) for n in ("v1", "v2", "p", "d") if n in fleet.procs}
        sampler = Sampler(lambda: {n: u for n, u in metrics.items() if fleet.procs[n].alive()},
                          fleet.usage)
        t0 = time.monotonic()
        sampler.start(t0)
        # a fault that overran pushes the next one back: the schedule's spacing (at most 60 s:
        # 30 s of recovery after one, 30 s of level before the next) from its end; none begins
        # in the schedule's last SETTLE s
        gap = faults[1].at - faults[0].at if len(faults) > 1 else 0.0
        runner = FaultRunner(fleet, faults, min_gap=min(2 * DEADLINE, gap),
                             deadline=seconds - SETTLE, recovery=DEADLINE + 5.0)
        load.hold = lambda: runner.hold_until
        runner.start(t0)
        samples = [s.row() for s in load.run_load(t0)]
        seconds = max(seconds, time.monotonic() - t0)  # a fault's recovery kept the load going
        runner.stop.set()
        runner.join(60)
        kv_idle = _kv_idle({n: u for n, u in metrics.items() if fleet.procs[n].alive()})
        sampler.stop.set()
        series = (hit_series(samples, seconds) if store_only else metrics_hit_series(sampler.rows))
        holders_rss = {f"h{i}": segment_size for i in range(1, holders + 1)}  # touched lazily
        result = report(samples, [f.row() for f in faults], series, sampler.rows, warmup, holders_rss,
                        **({} if store_only else VLLM_BASELINE))
        result.update(kv_idle=kv_idle, hosts="namespaces" if net else f"loopback ({why})", seconds=seconds,
                      clients=clients, store_only=store_only, load_policy=load_policy,
                      sampler=sampler.rows,
                      samples=samples, series=series, refill_lines=_refill_lines(workdir))
        return result
    finally:
        fleet.stop()
        if old_bind is None:
            os.environ.pop("MC_TCP_BIND_ADDRESS", None)
        else:
            os.environ["MC_TCP_BIND_ADDRESS"] = old_bind
        if net is not None:
            net.teardown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--faults", default="all", help=f"comma list of {sorted(KINDS)} or 'all'")
    p.add_argument("--repeat", type=int, default=2, help="times each fault runs (default 2)")
    p.add_argument("--warmup", type=float, default=60.0)
    p.add_argument("--store-only", action="store_true", help="pool clients only, no vLLM")
    p.add_argument("--loopback", action="store_true", help="no namespaces: every service on 127.0.0.1")
    p.add_argument("--model", type=Path, default=None, help="model dir (default: the tiny random Llama)")
    p.add_argument("--no-pd", action="store_true", help="no 1P1D pair (two kv_both instances only)")
    p.add_argument("--kv-cache-mib", type=int, default=8,
                   help="each vLLM instance's KV cache (default 8 MiB = 8k tokens of the tiny model, "
                        "a third of the 16 documents: the pool serves what the instance evicted)")
    p.add_argument("--load-policy", choices=("auto", "always", "never"), default="auto",
                   help="our connector's load_policy (default auto, as users run it). The tiny model "
                        "recomputes a 2k-token document faster than it loads, so auto declines most "
                        "pool hits and the hit rate the faults are judged by stays low and noisy; "
                        "always takes every hit (the pool's fault handling under the most loads)")
    p.add_argument("--out", type=Path, default=Path("bench-results/soak"))
    p.add_argument("--report", type=Path, default=None,
                   help="no soak: the report again from this soak JSON (with --warmup as it ran)")
    args = p.parse_args(argv)
    if args.kv_cache_mib < 2:
        p.error(f"--kv-cache-mib: got {args.kv_cache_mib}, expected >= 2 (one 2048-token request of the tiny model)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    kinds = (list(STORE_FAULTS if args.store_only else KINDS) if args.faults == "all"
             else args.faults.split(","))
    if args.report is not None:
        result = rebuild(args.report, args.warmup)
        return _finish(result, args.out)
    with tempfile.TemporaryDirectory(prefix="mvsoak-") as tmp:
        result = run(Path(tmp), seconds=args.minutes * 60, clients=args.clients, kinds=kinds,
                     repeat=args.repeat, store_only=args.store_only, loopback=args.loopback,
                     warmup=args.warmup, model=args.model, pd=not args.no_pd,
                     kv_cache_bytes=args.kv_cache_mib << 20, load_policy=args.load_policy)
    return _finish(result, args.out)


def _finish(result: dict[str, Any], out: Path) -> int:
    """Write JSON + PNG, print the tables; 0 when nothing was wrong and nothing failed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    samples = result.pop("samples", None) or []
    write(result, samples, result.get("series", []), out)
    print(table(result))
    print(json.dumps({k: result.get(k) for k in ("hosts", "requests", "wrong", "failed", "killed_in_flight",
                                                 "ttft_p50", "ttft_p99", "kv_idle")}))
    for name, lines in result.get("refill_lines", {}).items():
        print("\n".join(f"  {name}: {line}" for line in lines))
    for name, r in result["resources"].items():
        base = f", within vLLM's own growth: {r['within_baseline']}" if "within_baseline" in r else ""
        print(f"  {name}: rss {r['rss_mb']} MB (peak {r['peak'][0]}, {100 * r['rss_growth']:+.1f} %), "
              f"fds {r['fds']} (peak {r['peak'][1]}), within 10 %: {r['within']}{base}")
    return 0 if result["wrong"] == 0 and result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
