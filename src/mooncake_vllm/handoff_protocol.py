"""The store flow's hand-off wire protocol: what the proxy, a prefill and a decode instance
say to each other (through ``kv_transfer_params`` and one marker value in the pool).

* The proxy asks the prefill instance for a hand-off: :func:`ask_params`.
* The prefill instance answers with an :class:`Offer` (id, namespaces, chunk count,
  state); the proxy passes it on to the decode request unchanged: :func:`forward_offer`.
* Each prefill worker publishes a marker under :func:`handoff_key` once that request's
  saves are committed: :func:`marker_value`, read back by :func:`parse_marker`.
* A non-streamed decode answer reports how its wait ended: :func:`report_params`
  (``outcome`` ``ready``, ``nothing_to_wait_for``, ``not_waited`` or one of
  :data:`FALLBACK_REASONS`).

Runtime layer, imports nothing of the package: the V1 connector
(:mod:`mooncake_vllm.v1.handoff`, the scheduler-side state machine) and the proxy
(:mod:`mooncake_vllm.proxy.flows`) both speak it from here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FALLBACK_REASONS",
    "HANDOFF_PARAM",
    "OFFER_STATES",
    "VERSION",
    "Offer",
    "ask_params",
    "asks_for_handoff",
    "forward_offer",
    "handoff_key",
    "marker_value",
    "parse_marker",
    "report_params",
]

#: the entry of vLLM's ``kv_transfer_params`` that carries a prefill → decode hand-off
HANDOFF_PARAM = "mooncake_vllm_handoff"
#: protocol version, in every ask, offer and marker
VERSION = 1
#: ``saving`` (markers will follow), ``none`` (no full chunk to save), ``unavailable``
#: (the prefill's pool client is down: do not wait)
OFFER_STATES = ("saving", "none", "unavailable")
#: why a decode request that came with an offer did not get all the offered blocks
FALLBACK_REASONS = ("timeout", "prefill_failed", "prefill_unavailable", "missing",
                    "namespace_mismatch", "bad_offer")
_HEX = frozenset("0123456789abcdef")


def ask_params() -> dict[str, Any]:
    """What the proxy puts in the prefill request's ``kv_transfer_params``."""
    return {HANDOFF_PARAM: {"v": VERSION, "ask": True}}


def asks_for_handoff(params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` ask this (prefill) instance for an offer."""
    entry = params.get(HANDOFF_PARAM) if isinstance(params, Mapping) else None
    return isinstance(entry, Mapping) and entry.get("ask") is True


def forward_offer(params: Any) -> dict[str, Any] | None:
    """The decode request's ``kv_transfer_params`` from the prefill answer's ones: the
    offer passed on as it is (the decode validates it), ``None`` when there is none."""
    entry = params.get(HANDOFF_PARAM) if isinstance(params, Mapping) else None
    return {HANDOFF_PARAM: entry} if isinstance(entry, dict) else None


def handoff_key(prefix: str, handoff_id: str) -> str:
    """The marker a prefill worker publishes once every block of hand-off ``handoff_id``
    in namespace ``prefix`` (:meth:`~mooncake_vllm.keys.KeyNamespace.prefix`) is committed:
    ``mcv/<ns>/handoff/<id>``. Chunk keys are ``mcv/<ns>/<32 hex>``, so the two never collide."""
    if not handoff_id or not set(handoff_id) <= _HEX:
        raise ValueError(f"a hand-off id is lowercase hex, found {handoff_id!r}")
    return f"{prefix}/handoff/{handoff_id}"


@dataclass(frozen=True)
class Offer:
    """What a prefill instance names in its answer's ``kv_transfer_params``;
    ``state`` is one of :data:`OFFER_STATES`."""

    handoff_id: str
    namespaces: tuple[str, ...]
    chunks: int
    state: str = "saving"

    def to_params(self) -> dict[str, Any]:
        return {HANDOFF_PARAM: {"v": VERSION, "id": self.handoff_id,
                                "ns": list(self.namespaces), "chunks": self.chunks,
                                "state": self.state}}

    @classmethod
    def from_params(cls, params: Any) -> Offer | str | None:
        """The offer in a decode request's ``kv_transfer_params``; ``None`` when there is
        none, a reason string when it is malformed."""
        entry = params.get(HANDOFF_PARAM) if isinstance(params, Mapping) else None
        if entry is None:
            return None
        if not isinstance(entry, Mapping) or entry.get("ask") is True:
            return None if isinstance(entry, Mapping) else "bad_offer"
        hid, ns, chunks, state = (entry.get(k) for k in ("id", "ns", "chunks", "state"))
        if (entry.get("v") != VERSION or not isinstance(hid, str) or len(hid) != 32
                or not set(hid) <= _HEX
                or not isinstance(ns, list) or not ns or not all(isinstance(p, str) for p in ns)
                or isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0
                or state not in OFFER_STATES):
            return "bad_offer"
        return cls(hid, tuple(ns), chunks, state)


def marker_value(chunks: int, present: int) -> bytes:
    """The marker's payload: how many of the offered chunks are (leading and) present."""
    return json.dumps({"v": VERSION, "chunks": chunks, "present": present}).encode()


def parse_marker(raw: bytes | None) -> int | None:
    """Leading chunks present according to a marker; ``None`` if absent or unreadable."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        present = doc["present"]
    except (ValueError, TypeError, KeyError):
        return None
    return present if isinstance(present, int) and not isinstance(present, bool) else None


def report_params(outcome: str, waited: float, hit_tokens: int) -> dict[str, Any]:
    """A decode answer's ``kv_transfer_params``: how its hand-off ended, after how long a
    wait (``waited`` seconds), with how many prompt tokens from the pool."""
    return {HANDOFF_PARAM: {"outcome": outcome, "wait_ms": round(waited * 1e3, 3),
                            "hit_tokens": hit_tokens}}
