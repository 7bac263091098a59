"""The ``kv_aware`` policy's pure logic: per-instance block indexes fed by vLLM KV events,
prefix matching, and the expected cost of sending a prompt to each instance.

Block hashes are compared as their low 64 bits (:func:`norm_hash`): vLLM publishes
either the full ``bytes`` hash or, with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (the
default), ``int.from_bytes(hash, "big") & (2**64 - 1)``; both normalise alike.
A wrong match can only send a request to a worse instance: routing never decides
what KV an instance serves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LOCAL",
    "POOL",
    "POOL_MEDIUM",
    "BlockIndex",
    "Choice",
    "CostWeights",
    "choose",
    "norm_hash",
]

#: ``medium`` of our connector's pool events (the fact lives in ``v1/events.py``: the
#: proxy must not import the runtime's vLLM-importing module; a test keeps them equal)
POOL_MEDIUM = "MOONCAKE"
LOCAL, POOL = 1, 2  # medium bits: the instance's own tiers (GPU/CPU/...), the shared pool
_MASK64 = (1 << 64) - 1


def norm_hash(value: bytes | int) -> int:
    """The low 64 bits of a block hash, whichever form vLLM published."""
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(value, "big") & _MASK64
    return int(value) & _MASK64


def _medium_bit(medium: str | None) -> int:
    return POOL if medium == POOL_MEDIUM else LOCAL


class BlockIndex:
    """Which block hashes one instance holds, by medium; bounded (oldest dropped first).

    ``apply(seq, events)`` takes one decoded ``KVEventBatch``: a sequence number
    that is not the next one (a gap, or a restarted publisher counting from 0)
    drops everything first, since the events in between are unknown.
    """

    def __init__(self, capacity: int = 1 << 17) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self.block_size: int | None = None
        self.last_seq: int | None = None
        self.drops: dict[str, int] = {}
        self.events = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def count(self, bit: int) -> int:
        """Blocks held in medium ``bit`` (LOCAL or POOL)."""
        return sum(1 for bits in self._blocks.values() if bits & bit)

    def drop(self, reason: str) -> None:
        """Forget everything (the reason is counted)."""
        self._blocks.clear()
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def apply(self, seq: int, events: Iterable[Any]) -> str | None:
        """Apply one batch; returns ``"gap"``/``"restart"`` when the index was dropped first."""
        dropped = None
        if self.last_seq is not None and seq != self.last_seq + 1:
            dropped = "restart" if seq <= self.last_seq else "gap"
            self.drop(dropped)
        self.last_seq = seq
        for ev in events:
            self.apply_event(ev)
        return dropped

    def apply_event(self, ev: Any) -> None:
        """One event as msgpack decodes it: a dict with ``type`` (vLLM's tagged union)."""
        if not isinstance(ev, dict):
            return
        self.events += 1
        kind = ev.get("type")
        if kind == "BlockStored":
            size = ev.get("block_size")
            if isinstance(size, int) and size > 0:
                self.block_size = size
            self.stored(ev.get("block_hashes") or (), ev.get("medium"))
        elif kind == "BlockRemoved":
            self.removed(ev.get("block_hashes") or (), ev.get("medium"))
        elif kind == "AllBlocksCleared":
            self.cleared()

    def stored(self, hashes: Iterable[bytes | int], medium: str | None) -> None:
        bit = _medium_bit(medium)
        blocks = self._blocks
        for h in hashes:
            k = norm_hash(h)
            blocks[k] = blocks.get(k, 0) | bit
            blocks.move_to_end(k)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def removed(self, hashes: Iterable[bytes | int], medium: str | None) -> None:
        bit = _medium_bit(medium)
        for h in hashes:
            k = norm_hash(h)
            left = self._blocks.get(k, 0) & ~bit
            if left:
                self._blocks[k] = left
            else:
                self._blocks.pop(k, None)

    def cleared(self) -> None:
        """vLLM reset its prefix cache: its own tiers are empty, the pool is not."""
        for k in [k for k, bits in self._blocks.items() if bits & LOCAL]:
            left = self._blocks[k] & ~LOCAL
            if left:
                self._blocks[k] = left
            else:
                del self._blocks[k]

    def prefix_blocks(self, hashes: Sequence[int], bit: int) -> int:
        """How many leading ``hashes`` (normalised) this index holds in medium ``bit``."""
        n = 0
        for h in hashes:
            if not self._blocks.get(h, 0) & bit:
                break
            n += 1
        return n


@dataclass(frozen=True)
class CostWeights:
    """Cost of a prompt token, relative to recomputing it (1.0), and of an instance's load.

    ``pool``: a token loaded from the pool; ``local``: one hit in the instance's own
    cache; ``load``: each token of prefill work queued on the instance (the work this
    request waits for); ``per_request``: each request in flight on the instance beyond its
    prefill (its decode steps share the instance), in units of the mean prompt.

    ``load`` is 0.5, not 1: the work a request adds is not only its own wait. Where the
    fleet is busy it delays the requests after it as long as the queue delays this one,
    so a token recomputed elsewhere costs twice what a token queued costs; an idle fleet
    has no queue, and load does not matter. (At 1, a hot document's holder with one cold
    prompt queued sent the next turn elsewhere to be recomputed.)

    ``social``: the delay a placement imposes on the requests already in flight on the
    instance: its prefill work ``W`` stalls each of their next steps (a decode step, or a
    queued prefill) about as long as it runs, so ``W`` costs ``W * (1 + social * k)`` there
    with ``k`` requests in flight. A hit's few tokens cost little wherever it lands; a
    recompute (a cold document, a conversation moved off its holder) is kept away from an
    instance serving many. (Issue 29's bench: a hit waited 0.18-0.31 s with nothing else
    prefilling on its instance, 0.35-0.48 s behind one prefill, 0.55-0.75 s behind two, and
    seconds behind a recompute; each request decoding there added ~0.03 s.)
    """

    pool: float = 0.3
    local: float = 0.0
    load: float = 0.5
    per_request: float = 0.1
    social: float = 1.0


@dataclass(frozen=True)
class Choice:
    """The policy's decision for one prompt."""

    index: int  # into the candidates
    local_tokens: int  # predicted hit in the chosen instance's own cache
    pool_tokens: int  # predicted hit from the pool beyond that
    cost: float
    work: float = 0.0  # the prompt's own prefill work there, in recomputed-token units


def choose(prompt_tokens: int, local_hits: Sequence[int], pool_hit: int, loads: Sequence[float],
           weights: CostWeights = CostWeights(), start: int = 0, speeds: Sequence[float] | None = None,
           inflight: Sequence[float] | None = None) -> Choice:
    """The candidate of least expected cost (its prefill work, times the delay it imposes on the
    requests in flight there, plus the work queued before it, over its relative speed: an
    instance twice as fast does all of it in half the time); ties go to the first from ``start`` on.

    ``local_hits[i]``: prompt tokens in candidate i's own cache; ``pool_hit``: prompt
    tokens in the pool (the same for every candidate); ``loads[i]``: candidate i's queued
    work in recomputed-token units (:attr:`CostWeights.load` weighs it); ``speeds[i]``: candidate
    i's measured speed relative to the others (:mod:`.kv_speed`; all 1.0 if None); ``inflight[i]``:
    requests in flight on candidate i (:attr:`CostWeights.social` weighs them; none if None).
    """
    n = len(local_hits)
    best: Choice | None = None
    for k in range(n):
        i = (start + k) % n
        local = min(local_hits[i], prompt_tokens)
        pooled = max(0, min(pool_hit, prompt_tokens) - local)
        computed = prompt_tokens - local - pooled
        work = computed + weights.pool * pooled + weights.local * local
        social = 1.0 + weights.social * (inflight[i] if inflight else 0.0)
        cost = (work * social + weights.load * loads[i]) / (speeds[i] if speeds else 1.0)
        if best is None or cost < best.cost:
            best = Choice(i, local, pooled, cost, work)
    assert best is not None, "choose() needs at least one candidate"
    return best
