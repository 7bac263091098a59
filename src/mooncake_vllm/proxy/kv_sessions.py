"""Which prompts continue an earlier one on the same instance (``kv_aware``'s sessions).

A multi-turn conversation sends each turn as the one before plus its answer and a new
question: the new prompt's block hashes (chained, :mod:`.kv_hashes`) contain the last full
block of the turn before. :class:`SessionTails` keeps, per instance, the last full-block hash
of the prompts routed there (bounded, oldest dropped first), so the policy can tell a turn
that continues a session there from a new prompt that only shares a document with others.

Why it matters (``--kv-queue-cap``): moving a continuing turn off its instance recomputes the
whole conversation for one turn's gain, while a new conversation on a shared document moved
off a full instance pays one recompute of the document and has all its turns ahead of it on
an instance with room. Holding both on the holder kept 6 conversations of 3 documents on one
instance for 30 s of bench_routing 2026-12-05-capheld (its hits 0.7-3.9 s, the other two
instances at 1 request each); moving both recomputed conversations mid-way (2.5-6 s each).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["SessionTails"]


class SessionTails:
    """Per instance, the last full-block hashes of the prompts routed there (``per_instance`` at most)."""

    def __init__(self, per_instance: int = 4096) -> None:
        self.per_instance = per_instance
        self._tails: dict[str, OrderedDict[int, None]] = {}

    def record(self, instance: str, hashes: Sequence[int]) -> None:
        """A prompt with these (normalised) block hashes went to ``instance``."""
        if not hashes:
            return
        tails = self._tails.setdefault(instance, OrderedDict())
        tails[hashes[-1]] = None
        tails.move_to_end(hashes[-1])
        while len(tails) > self.per_instance:
            tails.popitem(last=False)

    def continues(self, instance: str, hashes: Sequence[int], blocks: int) -> bool:
        """Whether the prompt's first ``blocks`` blocks hold the whole of an earlier prompt
        routed to ``instance`` (its last full block among them)."""
        tails = self._tails.get(instance)
        return tails is not None and any(h in tails for h in hashes[:blocks])

    def forget(self, instance: str) -> None:
        """``instance`` left rotation: a restarted engine holds none of its sessions."""
        self._tails.pop(instance, None)
