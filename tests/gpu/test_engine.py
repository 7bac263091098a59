"""The V1 connector in the REAL vLLM engine on a CUDA GPU (skipped without one).

A random bf16 Llama built on the GPU; instance A serves long prompts and saves
them to a real Mooncake pool (master + holder on loopback); a fresh process B
gets them from the pool (vLLM's own cached-token count) and its output equals
an in-HBM prefix hit of the same prompts; no PYTHONHASHSEED anywhere.
The TTFT comparison with vLLM's in-tree connector is bench/bench_gpu_ttft.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from mooncake_vllm.services import LocalStack  # noqa: E402

LENGTHS = (2000, 6000)
BS = 16  # vLLM's default block size on CUDA


def _model(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def _run(model: Path, prompts: Path, work: Path, name: str, mode: str, repeat: bool,
         env: dict[str, str], *extra: str) -> list[dict]:
    return _report(model, prompts, work, name, mode, repeat, env, *extra)["runs"]


def _report(model: Path, prompts: Path, work: Path, name: str, mode: str, repeat: bool,
            env: dict[str, str], *extra: str) -> dict:
    out = work / f"{name}.json"
    with open(work / f"{name}.log", "wb") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_instance.py")),
                               str(model), str(prompts), str(out), mode, "1" if repeat else "0",
                               *extra],
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=300,
                              start_new_session=True)
    assert proc.returncode == 0, (work / f"{name}.log").read_text(errors="replace")[-3000:]
    return json.loads(out.read_text())


def test_cross_instance_pool_hit_equals_an_in_hbm_prefix_hit(tmp_path: Path) -> None:
    model = _model(tmp_path / "model")
    rnd = random.Random(7)
    prompts = [[rnd.randrange(100, 31000) for _ in range(n)] for n in LENGTHS]
    prompts_path = tmp_path / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.pop("MOONCAKE_VLLM_DISABLE", None)
    plain = _run(model, prompts_path, tmp_path, "none", "none", True, env)
    in_hbm = plain[1::2]
    assert [r["cached"] for r in in_hbm] == [(n - 1) // BS * BS for n in LENGTHS]
    stack = LocalStack(tmp_path / "stack", metadata="p2p", segment_size=4 << 30,
                       local_buffer_size=256 << 20, client_ttl=30).start()
    try:
        env_pool = {**env, **stack.env()}
        a = _run(model, prompts_path, tmp_path, "A", "ours", False, env_pool)
        assert [r["cached"] for r in a] == [0] * len(LENGTHS)
        assert [r["tokens"] for r in a] == [r["tokens"] for r in plain[0::2]]
        b = _run(model, prompts_path, tmp_path, "B", "ours", False, env_pool)
    finally:
        stack.stop()
    assert [r["cached"] for r in b] == [(n - 1) // BS * BS for n in LENGTHS]  # from the pool
    assert [r["tokens"] for r in b] == [r["tokens"] for r in in_hbm]
    assert "snapshot saves" in (tmp_path / "A.log").read_text(errors="replace")


def test_saves_of_preempted_requests_store_only_the_right_kv(tmp_path: Path) -> None:
    """A: prompts decoding at once in a KV cache too small for all (vLLM preempts and reuses
    their blocks while our snapshot copies may still read them); B, a fresh process, loads
    every prompt from the pool: its output equals an in-HBM prefix hit, so A stored no
    block's bytes under another's key."""
    model = _model(tmp_path / "model")
    rnd = random.Random(11)
    prompts = [[rnd.randrange(100, 31000) for _ in range(496)] for _ in range(4)]
    prompts_path = tmp_path / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.pop("MOONCAKE_VLLM_DISABLE", None)
    in_hbm = _run(model, prompts_path, tmp_path, "none", "none", True, env)[1::2]
    stack = LocalStack(tmp_path / "stack", metadata="p2p", segment_size=4 << 30,
                       local_buffer_size=256 << 20, client_ttl=30).start()
    try:
        env_pool = {**env, **stack.env()}
        a = _report(model, prompts_path, tmp_path, "A", "ours", False, env_pool, "preempt")
        assert a["preemptions"] > 0, "nothing was preempted: the test proves nothing"
        b = _run(model, prompts_path, tmp_path, "B", "ours", False, env_pool)
    finally:
        stack.stop()
    assert [r["cached"] for r in b] == [480] * len(prompts)  # every full block from the pool
    assert [r["tokens"] for r in b] == [r["tokens"] for r in in_hbm]
