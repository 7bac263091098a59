"""Per-flow, per-version request shaping (pure logic)."""

from __future__ import annotations

import json

import pytest

from mooncake_vllm.errors import ConfigError, UnsupportedVersionError
from mooncake_vllm.proxy import flows
from mooncake_vllm.proxy.instances import Instance, parse_endpoint


@pytest.mark.parametrize(
    ("version", "mode"),
    [("0.13.0", "handoff"), ("0.15.1", "handoff"), ("0.16.0rc1", "bootstrap"), ("0.32.0", "bootstrap"),
     ("v0.33", "bootstrap"), ("1.0.0.dev3+gabc", "bootstrap")],
)
def test_p2p_mode_by_version(version: str, mode: str) -> None:
    assert flows.p2p_mode(flows.release_triple(version)) == mode


def test_old_or_garbled_versions_are_refused() -> None:
    with pytest.raises(UnsupportedVersionError, match="target is 0.12.0"):
        flows.p2p_mode((0, 12, 0))
    with pytest.raises(ConfigError, match="--target-vllm"):
        flows.release_triple("latest")


def test_prefill_body_store_and_p2p() -> None:
    body = {"prompt": "p", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "n": 3, "min_tokens": 5}
    store = flows.prefill_body(body, "store", "", "tid")
    assert store == {"prompt": "p", "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                     "kv_transfer_params": {"mooncake_vllm_handoff": {"v": 1, "ask": True}}}
    assert body["max_tokens"] == 50  # the client's body is not mutated
    boot = flows.prefill_body(body, "p2p", "bootstrap", "tid")
    assert boot["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "tid"}
    hand = flows.prefill_body(body, "p2p", "handoff", "tid")
    assert "transfer_id" not in hand["kv_transfer_params"]


def test_plan_decode_bootstrap_needs_an_engine_id() -> None:
    pre = Instance("prefill", parse_endpoint("[::1]:8100@50052"))
    with pytest.raises(ValueError, match="no engine id for DP rank 0"):
        flows.plan_decode("p2p", "bootstrap", pre, "t", None, 0)
    pre.engine_ids = flows.parse_engine_ids({"0": {"engine_id": "e0", "worker_addr": {}}, "1": {"engine_id": "e1"}})
    plan = flows.plan_decode("p2p", "bootstrap", pre, "t", None, 1)
    assert plan.decode_params == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
                                  "remote_bootstrap_addr": "http://[::1]:50052", "remote_dp_rank": 1,
                                  "transfer_id": "t"}
    assert flows.plan_decode("store", "", pre, "t", None).decode_params is None


def test_store_flow_passes_the_prefills_offer_and_nothing_else() -> None:
    pre = Instance("prefill", parse_endpoint("127.0.0.1:8100"))
    offer = {"v": 1, "id": "ab" * 16, "ns": ["mcv/0123456789abcdef"], "chunks": 3, "state": "saving"}
    answer = {"choices": [], "kv_transfer_params": {"mooncake_vllm_handoff": offer, "other": 1}}
    raw = json.dumps(answer).encode()
    plan = flows.plan_decode("store", "", pre, "t", flows.parse_prefill_answer("store", "", raw))
    assert plan.decode_params == {"mooncake_vllm_handoff": offer}
    # no offer (V0, another connector, a non-JSON answer): the decode body stays the client's
    for raw in (b'{"choices": []}', b"not json", b"[1]", b'{"kv_transfer_params": {"x": 1}}'):
        pre_json = flows.parse_prefill_answer("store", "", raw)
        assert flows.plan_decode("store", "", pre, "t", pre_json).decode_params is None
    with pytest.raises(ValueError):
        flows.parse_prefill_answer("p2p", "handoff", b"not json")
    assert flows.parse_prefill_answer("p2p", "bootstrap", b"not json") is None


def test_parse_engine_ids_accepts_both_query_shapes() -> None:
    assert flows.parse_engine_ids({"eng": {"0": {}, "1": {}}}) == {0: "eng", 1: "eng"}
    assert flows.parse_engine_ids([]) == {}
