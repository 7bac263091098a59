"""What the scheduler-side connector tells the workers each step.

Chunks travel as rank-independent digests (hex); each worker prepends its own
namespace prefix, so one metadata object serves every TP/PP rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:  # the real base when vLLM is importable; a plain object for pure-logic use
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except Exception:  # noqa: BLE001 - vLLM missing or unimportable
    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in base when vLLM is not installed."""

__all__ = ["BlockJob", "MooncakeConnectorMetadata"]


@dataclass
class BlockJob:
    """Move the blocks of one request: chunk digest ``digests[i]`` ↔ block ``block_ids[i]``."""

    req_id: str
    digests: list[str]
    block_ids: list[int]
    #: load in the background; reported through ``get_finished``'s finished-receiving set
    background: bool = False
    #: a save from blocks no request holds (vLLM's prefix cache, :mod:`.refill`): captured
    #: in this step, never tracked for a delayed free; vLLM may reuse them after it
    unheld: bool = False
    #: ``save_admission: "repeat"`` with no answer yet in what may be the request's last
    #: step (:mod:`.admission`): captured, and the save thread stores only repeats
    ask_admission: bool = False

    def __post_init__(self) -> None:
        if len(self.digests) != len(self.block_ids):
            raise ValueError(f"request {self.req_id}: {len(self.digests)} chunk digests for "
                             f"{len(self.block_ids)} blocks")


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    """One step's work: loads (before the forward) and saves (after it)."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    #: the release reports preemptions (vLLM >= 0.14): a CUDA snapshot's copy may
    #: outlive the forward pass, since the workers hear before any block is reused
    preemptions_reported: bool = False
    #: finished while their background load ran: vLLM keeps their blocks until the
    #: workers report them (finished-sending) once the load is over
    delayed_loads: set[str] = field(default_factory=set)
    #: ``save_admission: "repeat"``: chunks first seen this step (:mod:`.admission`); the
    #: workers put their marks, nothing is captured
    marks: list[str] = field(default_factory=list)
    #: req_id -> (hand-off id, digests of every full prompt chunk): publish the marker
    #: once this step's and earlier saves of the request are committed
    handoffs: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    #: the step schedules no token (every request waits, e.g. for its background
    #: load): the workers may block briefly in ``get_finished`` for a load to end
    idle_step: bool = False
    #: the step's work (scheduled tokens, attention work, furthest prefill position):
    #: the workers time the step and report both to the claim policy (:mod:`~mooncake_vllm.v1.perf`)
    step_work: tuple[float, float, float] | None = None
    #: the claim policy declines and wants the pool measured: the workers run a background
    #: probe of throw-away loads (:func:`~mooncake_vllm.store.probe.probe_loads`), if they can
    probe_loads: bool = False
