"""The hand-off wire protocol: asks, offers, markers and reports as they travel between the
proxy, a prefill and a decode instance. Pure values: the state machines that speak it are
tested in tests/v1/test_handoff.py, the proxy's use in tests/proxy/test_flows.py."""

from __future__ import annotations

import json

import pytest

from mooncake_vllm.handoff_protocol import (
    FALLBACK_REASONS,
    HANDOFF_PARAM,
    Offer,
    ask_params,
    asks_for_handoff,
    forward_offer,
    handoff_key,
    marker_value,
    parse_marker,
    report_params,
)
from mooncake_vllm.keys import KeyNamespace, chunk_keys

NS = KeyNamespace("m", "float32", "cpu:vec:float32:L2:2x4x64", 4)
HID = "ab" * 16


def test_the_ask_is_recognised_and_nothing_else_is() -> None:
    assert ask_params() == {HANDOFF_PARAM: {"v": 1, "ask": True}}
    assert asks_for_handoff(ask_params())
    offer = Offer(HID, (NS.prefix(),), 3).to_params()
    for params in (offer, None, {}, {HANDOFF_PARAM: "x"}, {HANDOFF_PARAM: {"ask": "yes"}}, [1]):
        assert not asks_for_handoff(params)


def test_offer_parsing_refuses_what_it_cannot_trust() -> None:
    good = Offer(HID, (NS.prefix(),), 3).to_params()
    assert good == {HANDOFF_PARAM: {"v": 1, "id": HID, "ns": [NS.prefix()], "chunks": 3,
                                    "state": "saving"}}
    assert Offer.from_params(good) == Offer(HID, (NS.prefix(),), 3)
    assert Offer.from_params(None) is None and Offer.from_params({}) is None
    assert Offer.from_params(ask_params()) is None  # a prefill request, not an offer
    for change in ({"id": "AB" * 16}, {"id": "ab"}, {"ns": []}, {"chunks": -1}, {"chunks": True},
                   {"state": "done"}, {"v": 2}):
        assert Offer.from_params({HANDOFF_PARAM: {**good[HANDOFF_PARAM], **change}}) == "bad_offer"
    assert Offer.from_params({HANDOFF_PARAM: "x"}) == "bad_offer"
    assert "bad_offer" in FALLBACK_REASONS


def test_the_proxy_forwards_the_offer_unchanged_or_nothing() -> None:
    offer = Offer(HID, (NS.prefix(),), 3, "none").to_params()
    assert forward_offer({**offer, "other": 1}) == offer
    for params in (None, {}, {HANDOFF_PARAM: "x"}, "text"):
        assert forward_offer(params) is None


def test_marker_keys_never_collide_with_chunk_keys_and_refuse_foreign_ids() -> None:
    key = handoff_key(NS.prefix(), HID)
    assert key == f"{NS.prefix()}/handoff/{HID}"
    assert key not in chunk_keys(NS, list(range(64)))
    for bad in ("", "../x", "AB" * 16):
        with pytest.raises(ValueError, match="lowercase hex"):
            handoff_key(NS.prefix(), bad)


def test_marker_payload_round_trips() -> None:
    assert parse_marker(marker_value(4, 3)) == 3
    assert json.loads(marker_value(4, 4)) == {"v": 1, "chunks": 4, "present": 4}
    assert parse_marker(None) is None and parse_marker(b"{") is None
    assert parse_marker(b'{"present": true}') is None and parse_marker(b"[]") is None


def test_the_decode_report_names_outcome_wait_and_hits() -> None:
    assert report_params("ready", 0.0123456, 16) == {
        HANDOFF_PARAM: {"outcome": "ready", "wait_ms": 12.346, "hit_tokens": 16}}
