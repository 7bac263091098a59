"""What the V1 scheduler side remembers about one live request (:mod:`.scheduler`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestState"]


@dataclass
class RequestState:
    """What the scheduler side remembers about one live request."""

    req_id: str
    prompt_len: int
    digests: list[str]
    #: (first chunk, chunk count, vLLM's computed tokens) of an accepted lookup
    pending_load: tuple[int, int, int] | None = None
    loaded_upto: int = 0  # chunks [0, loaded_upto) came from (so are in) the pool
    saved_upto: int = 0  # chunks [0, saved_upto) were handed to the workers to save
    #: chunks [0, local_upto) are vLLM's own prefix-cache hits: this instance saved them
    #: when it computed them (or loaded them from the pool), so they are not captured again
    local_upto: int = 0
    #: chunks [0, present_upto) the last lookup found in the pool; a declined claim
    #: recomputes them, and saving them again would only copy 2 GB for a 16k prompt
    #: beside the next load (measured on the H200: loads then took 2-3x as long)
    present_upto: int = 0
    #: the first of vLLM's own prefix-cache hits the pool lacks (:mod:`.audits`): saved again
    pool_gap: int | None = None
    has_saves: bool = False
    #: tokens computed once the planned load lands; cleared when vLLM schedules them
    promised: int = 0
    #: a load of this request failed: never offer it the pool again (the values that
    #: failed are likely still there, and a retry would fail the same way, forever)
    refuse_loads: bool = False
    #: when it was first deferred for another request's load of its chunks
    shared_wait_since: float | None = None
    #: chunks [saved_upto, admission_wait_upto) are computed, their saves waiting for the
    #: admission's answer (:mod:`.admission`)
    admission_wait_upto: int = 0
    #: the first chunk of a span not looked up because no hit of it would be claimed (its
    #: admission answer then counts the tokens declined)
    unasked_from: int | None = None
    block_ids: list[int] = field(default_factory=list)  # mirror for engines without block state
    request: Any = None  #: vLLM's request (its block hashes name the pool's blocks in KV events)

    def claimable(self, block_size: int) -> int:
        """Chunks a lookup may claim: never the one holding the last prompt token (vLLM must
        compute at least one)."""
        return (self.prompt_len - 1) // block_size
