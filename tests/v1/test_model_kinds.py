"""Other KV-cache kinds on the REAL vLLM V1 CPU engine with a REAL Mooncake pool.

* MLA (a tiny random DeepSeek-V2): the latent KV is keyed with no TP rank
  (``tp=shared``), stored once and loaded bit-exact. Default run: two engine starts.
* Hybrid models (opt-in, ``MOONCAKE_VLLM_MODEL_KINDS=1``: four more engine
  starts): a Gemma-2 style model mixing sliding-window and full layers hits
  token-identically (vLLM gives it one full-attention group); one whose layers
  are all sliding-window is refused at start with its group named.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
from instances import announced_namespace, hits, loads_here, prompt, tokens, vllm_source_contains

from mooncake_vllm.config import load_store_config
from mooncake_vllm.demo.run import run_instance
from mooncake_vllm.demo.tiny_kinds import SLIDING_WINDOW, cached_tiny_kind
from mooncake_vllm.keys import chunk_keys
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient

pytestmark = pytest.mark.vllm

opt_in = pytest.mark.skipif(
    not os.environ.get("MOONCAKE_VLLM_MODEL_KINDS"),
    reason="opt-in (four engine starts): set MOONCAKE_VLLM_MODEL_KINDS=1")


@pytest.fixture(scope="module")
def run(module_local_stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``run(model, name=..., prompts=..., **run_instance options)`` on the module's pool."""
    return functools.partial(run_instance, workdir=tmp_path_factory.mktemp("model-kinds"),
                             env=module_local_stack.env())


@pytest.fixture(scope="module")
def client(module_local_stack: LocalStack) -> Any:
    c = StoreClient.connect(load_store_config(module_local_stack.config_path))
    yield c
    c.close()


@pytest.mark.skipif(not loads_here() or not vllm_source_contains("engine/arg_utils.py", "attention_config"),
                    reason="needs a vLLM that picks the CPU MLA kernel by attention_config and where "
                           "our connector loads (0.11.1+)")
def test_mla_latent_kv_is_stored_once_and_loaded_bit_exact(run: Any, client: StoreClient) -> None:
    """Stored once under ``tp=shared``; B's loaded blocks are A's computed blocks, bit for bit.

    Not token identity over the whole output: vLLM's CPU MLA computes the tokens after
    a loaded prefix through its prefill-with-context path (which vLLM itself never
    takes on CPU: it turns prefix caching and chunked prefill off for MLA there); its
    rounding differs from a full prefill's, and this random model amplifies that
    within a few decode steps. The first token, decided by the prompt, must agree.
    """
    model = cached_tiny_kind("mla")
    bs = 16  # vLLM's CPU MLA kernel runs block size 16 only
    prompts = [prompt(11, 100)]  # one prompt: its blocks stay in both caches to compare
    # the reference MLA kernel: on AMX hosts vLLM picks AMX MLA, which refuses float32 weights
    env = {**run.keywords["env"], "MOONCAKE_VLLM_DEMO_KV_DIGESTS": "1",
           "MOONCAKE_VLLM_DEMO_ATTENTION_BACKEND": "CPU_MLA"}
    # a producer never loads: it computes every token itself
    a = run(model, name="mla-A", prompts=prompts, block_size=bs, role="kv_producer", env=env)
    assert hits(a) == 0
    ns = announced_namespace(a["log"])
    assert ns.tp_shared and ns.layout.endswith(":float32:L2:1x16x576"), ns.describe()
    full = sum(len(p) // bs for p in prompts)
    assert all(all(client.exists(chunk_keys(ns, p))) for p in prompts)
    assert a["connector"]["store_blocks_put"] == full
    b = run(model, name="mla-B", prompts=prompts, block_size=bs, role="kv_consumer", env=env)
    claimable = sum((len(p) - 1) // bs for p in prompts)
    assert hits(b) >= claimable * bs > 0
    assert b["connector"]["worker_loaded_blocks"] >= claimable
    assert b["connector"]["worker_failed_blocks"] == 0
    assert b["connector"]["store_blocks_put"] == 0
    # every loaded block holds exactly the bytes A computed for it
    assert len(set(a["kv_block_digests"]) & set(b["kv_block_digests"])) >= claimable == 6
    assert [t[0] for t in tokens(b)] == [t[0] for t in tokens(a)]


@opt_in
def test_sliding_window_hybrid_hits_token_identically(run: Any) -> None:
    model = cached_tiny_kind("sliding")
    prompts = [prompt(21, 100)]  # 3 full blocks of 32, far beyond the 16-token window
    base = run(model, name="swa-base", prompts=prompts, role="none")
    a = run(model, name="swa-A", prompts=prompts)
    assert tokens(a) == tokens(base) and hits(a) == 0
    b = run(model, name="swa-B", prompts=prompts)
    assert tokens(b) == tokens(base)
    assert hits(b) >= 96 > SLIDING_WINDOW
    assert b["connector"]["worker_loaded_blocks"] >= 3
    assert b["connector"]["worker_failed_blocks"] == 0


@opt_in
def test_all_sliding_window_model_is_refused_at_start(run: Any) -> None:
    model = cached_tiny_kind("all-sliding")
    with pytest.raises(RuntimeError) as err:
        run(model, name="all-swa", prompts=[prompt(31, 40)])
    log = str(err.value)
    assert "UnsupportedModelError" in log and "its KV cache group is SlidingWindowSpec" in log
    assert f"window {SLIDING_WINDOW}" in log and "Fix:" in log
