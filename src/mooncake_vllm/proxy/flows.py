"""What the proxy sends to the prefill and the decode instance, per flow and vLLM version.

* ``store``: the prefill instance gets a ``max_tokens=1`` copy of the request
  (its KV lands in the Mooncake pool through the connector), then the decode
  instance gets the original request and loads the prompt's KV from the pool.
  The prefill request asks for a hand-off (``kv_transfer_params``); a V1
  ``MooncakeStoreConnector`` answers with an offer naming what it is saving,
  which goes to the decode request, whose connector waits (bounded) until those
  blocks are committed instead of racing the prefill's saves
  (:mod:`mooncake_vllm.handoff_protocol`). An answer without an offer (V0, another
  connector) leaves the decode request as the client sent it.
* ``kv_both``: no separate prefill: each request goes to one ``kv_both`` instance
  (listed as ``--decode``) that prefills from its own cache or the pool and decodes.
* ``p2p``: vLLM V1 ``MultiConnector(MooncakeConnector + MooncakeStoreConnector)``.
  The in-tree P2P ``MooncakeConnector`` needs ``kv_transfer_params``:

  - 0.13.0 - 0.15.x (``handoff``): prefill gets ``{do_remote_decode: true,
    do_remote_prefill: false}``; its response carries ``kv_transfer_params``
    (``do_remote_prefill``, ``remote_host``, ``remote_port``...) which go to the
    decode request as they are.
  - 0.16.0+ (``bootstrap``): both sides share a ``transfer_id`` chosen by the
    proxy; the decode additionally needs ``remote_engine_id`` and
    ``remote_bootstrap_addr`` (``http://host:port`` of the prefill's bootstrap
    server, whose ``GET /query`` maps DP rank -> engine id). The prefill
    response carries no params.
  - before 0.13.0 there is no P2P ``MooncakeConnector``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.compat.versions import release_of, vllm_facts
from mooncake_vllm.errors import UnsupportedVersionError
from mooncake_vllm.handoff_protocol import ask_params, forward_offer
from mooncake_vllm.proxy.instances import Instance

__all__ = [
    "FLOWS",
    "P2P_MODES",
    "FlowPlan",
    "new_transfer_id",
    "p2p_mode",
    "parse_prefill_answer",
    "parse_engine_ids",
    "release_triple",
    "plan_decode",
    "prefill_body",
]

FLOWS: tuple[str, ...] = ("store", "p2p", "kv_both")
P2P_MODES: tuple[str, str] = ("handoff", "bootstrap")


def release_triple(text: str, *, field_name: str = "--target-vllm") -> tuple[int, int, int]:
    """``"0.16.0rc1"`` -> ``(0, 16, 0)`` (PEP 440 via ``compat.versions``); ``ConfigError`` naming the field."""
    major, minor, patch = (int(p) for p in release_of(str(text), what=field_name).split(".")[:3])
    return major, minor, patch


def p2p_mode(version: tuple[int, int, int]) -> str:
    """The P2P ``kv_transfer_params`` protocol a vLLM release speaks: ``handoff`` or ``bootstrap``."""
    shown = ".".join(map(str, version))
    mode = vllm_facts(shown, strict=False).p2p_transfer_params
    if mode is None:
        raise UnsupportedVersionError(
            f"--flow p2p needs vLLM's P2P MooncakeConnector (vLLM >= 0.13.0), but the target is {shown}; "
            "use --flow store with MooncakeStoreConnector, or upgrade vLLM"
        )
    return mode


def parse_engine_ids(payload: Any) -> dict[int, str]:
    """DP rank -> engine id from a bootstrap ``GET /query`` answer.

    0.16.0+ answers ``{dp_rank: {"engine_id": ..., "worker_addr": ...}}``; some
    revisions answered ``{engine_id: {dp_rank: ...}}``. Both are accepted.
    """
    out: dict[int, str] = {}
    if not isinstance(payload, dict):
        return out
    for key, entry in payload.items():
        if isinstance(entry, dict) and "engine_id" in entry:
            out[int(key)] = str(entry["engine_id"])
        elif isinstance(entry, dict):
            for rank in entry:
                out[int(rank)] = str(key)
    return out


def prefill_body(body: dict[str, Any], flow: str, mode: str, transfer_id: str) -> dict[str, Any]:
    """The JSON sent to the prefill instance: one token, no streaming."""
    req = dict(body)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    req.pop("n", None)  # one sequence is enough to fill the KV cache
    req.pop("min_tokens", None)  # would exceed max_tokens=1 and be rejected
    if flow == "p2p":
        params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        if mode == "bootstrap":
            params["transfer_id"] = transfer_id
        req["kv_transfer_params"] = params
    elif flow == "store":
        req["kv_transfer_params"] = ask_params()
    return req


def parse_prefill_answer(flow: str, mode: str, raw: bytes) -> dict[str, Any] | None:
    """The prefill's JSON answer where the flow reads it: p2p ``handoff`` needs it
    (``ValueError`` when it is not JSON); the store flow uses it if it is JSON."""
    if flow == "p2p":
        return json.loads(raw) if mode == "handoff" else None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class FlowPlan:
    """The decode request's ``kv_transfer_params`` (None: send the body unchanged)
    and the prefill's DP rank header, if any."""

    decode_params: dict[str, Any] | None
    dp_rank: int | None = None


def plan_decode(
    flow: str,
    mode: str,
    prefill: Instance,
    transfer_id: str,
    prefill_response: dict[str, Any] | None,
    dp_rank: int | None = None,
) -> FlowPlan:
    """Decode-side params once the prefill answered; ``ValueError`` when the
    prefill's answer lacks what the decode needs (the caller turns it into a 502)."""
    if flow == "store":
        return FlowPlan(forward_offer((prefill_response or {}).get("kv_transfer_params")))
    if mode == "handoff":
        params = (prefill_response or {}).get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise ValueError(
                f"prefill instance {prefill.key} returned no kv_transfer_params with do_remote_prefill; "
                "is it running MooncakeConnector with kv_role kv_producer?"
            )
        return FlowPlan(params)
    rank = dp_rank if dp_rank is not None else 0
    engine_id = prefill.engine_ids.get(rank)
    if engine_id is None:
        raise ValueError(
            f"prefill instance {prefill.key} has no engine id for DP rank {rank} from its bootstrap server "
            f"{prefill.endpoint.bootstrap_url}/query; check VLLM_MOONCAKE_BOOTSTRAP_PORT and the @port suffix"
        )
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": prefill.endpoint.bootstrap_url,
        "remote_dp_rank": rank,
        "transfer_id": transfer_id,
    }
    return FlowPlan(params, rank)


def new_transfer_id() -> str:
    """A fresh id shared by the prefill and the decode of one request."""
    return uuid.uuid4().hex
