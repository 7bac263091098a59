"""Background loads in flight, as the scheduler sees them (one load per block at a time).

Which request's load brings each chunk (another request wanting one waits for it, then
hits vLLM's own prefix cache), how many tokens are still loading (the backlog a new claim
waits behind) and since when (what a claimed load took, for the claim policy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["InflightLoads"]


class InflightLoads:
    """Loads claimed and not yet reported over; one left longer than ``expire_after`` s is
    dropped (a report vLLM never sent must not block the chunks for ever)."""

    def __init__(self, clock: Callable[[], float], expire_after: float) -> None:
        self._clock = clock
        self.expire_after = expire_after
        self._by_chunk: dict[str, str] = {}  # chunk digest -> request whose load brings it
        self._by_request: dict[str, tuple[int, float]] = {}  # request -> (tokens, since)

    def add(self, req_id: str, digests: Iterable[str], tokens: int) -> None:
        """``req_id``'s load of ``digests`` (``tokens`` in all) was just planned."""
        for digest in digests:
            self._by_chunk.setdefault(digest, req_id)
        self._by_request[req_id] = (tokens, self._clock())

    def tokens(self) -> int:
        """Tokens of the loads in flight."""
        self._expire()
        return sum(tokens for tokens, _ in self._by_request.values())

    def brought_by_another(self, req_id: str, wanted: Iterable[str]) -> bool:
        """Whether another request's load in flight brings any of the ``wanted`` chunks."""
        self._expire()
        return bool(self._by_chunk) and any(self._by_chunk.get(d, req_id) != req_id for d in wanted)

    def over(self, req_ids: Iterable[str]) -> list[tuple[str, int, float]]:
        """These requests' loads are over: ``(request, tokens, seconds since planned)`` each."""
        now, ended = self._clock(), []
        for req_id in req_ids:
            if (entry := self._by_request.pop(req_id, None)) is not None:
                self._by_chunk = {d: r for d, r in self._by_chunk.items() if r != req_id}
                ended.append((req_id, entry[0], now - entry[1]))
        return ended

    def _expire(self) -> None:
        now = self._clock()
        stale = [r for r, (_, since) in self._by_request.items() if now - since > self.expire_after]
        if stale:
            self.over(stale)
