"""PoolAudit and HbmRefill (v1/refill.py): which chunks are due for a check of the pool, and
what vLLM's prefix cache still holds once the pool is back after an outage."""

from __future__ import annotations

from types import SimpleNamespace

from mooncake_vllm.v1.refill import LOSS_GAP, HbmRefill, PoolAudit, cached_block


class Clock:
    now = 50.0

    def __call__(self) -> float:
        return self.now


def test_chunks_found_recently_are_not_due_and_turn_due_after_the_interval() -> None:
    clock = Clock()
    audit = PoolAudit(interval=10.0, clock=clock)
    assert audit.due_from(["a", "b", "c"]) == 0
    audit.found(["a", "b"])
    assert audit.due_from(["a", "b", "c"]) == 2
    assert audit.due_from(["a", "b"]) is None
    clock.now += 9.9
    assert audit.due_from(["a", "b"]) is None
    clock.now += 0.1
    assert audit.due_from(["a", "b"]) == 0


def test_the_least_recently_found_are_forgotten_first() -> None:
    clock = Clock()
    audit = PoolAudit(interval=10.0, capacity=2, clock=clock)
    audit.found(["a", "b"])
    audit.found(["a"])  # a found again: b is now the oldest
    audit.found(["c"])
    assert audit.due_from(["a"]) is None and audit.due_from(["c"]) is None
    assert audit.due_from(["b"]) == 0


def test_forget_makes_every_chunk_due() -> None:
    audit = PoolAudit(interval=10.0, clock=Clock())
    audit.found(["a", "b"])
    audit.forget()
    assert audit.due_from(["a", "b"]) == 0


def test_a_prefix_found_whole_is_trusted_as_one_until_a_chunk_of_it_is_not() -> None:
    """The next request on a document asks once, not per chunk, and answers exactly as a scan
    would: an unfound chunk, a forget, a chunk forgotten for capacity, or the oldest chunk's
    trust running out makes the prefix due again from the right chunk."""
    clock = Clock()
    audit = PoolAudit(interval=10.0, capacity=4, clock=clock)
    doc = ["a", "b", "c"]
    audit.found(doc)
    clock.now += 5
    audit.found(["c"])
    assert audit.due_from(doc) is None and audit.due_from(doc + ["x"], 3) is None
    audit.unfound(["b"])
    assert audit.due_from(doc) == 1
    audit.found(["b"])
    assert audit.due_from(doc) is None
    clock.now += 5  # a's trust ran out (b and c were found 5 s ago)
    assert audit.due_from(doc) == 0
    audit.found(doc)
    assert audit.due_from(doc) is None
    audit.found(["x", "y"])  # capacity 4: a is forgotten
    assert audit.due_from(doc) == 0
    audit.found(doc)
    assert audit.due_from(doc) is None
    audit.forget()
    assert audit.due_from(doc) == 0
    assert audit.due_from([]) is None and audit.due_from(doc, 0) is None


def test_a_sweep_remembers_the_requests_still_running_first() -> None:
    """Running requests are not remembered on every new request (vLLM's thread) but asked
    for when a sweep starts: theirs are re-saved first."""
    clock = Clock()
    running = [(["r0", "r1"], ["hr0", "hr1"])]
    refill = HbmRefill(per_step=8, clock=clock, wall=lambda: 0.0, live=lambda: running)
    refill.resolve = {"ha0": 10, "hr0": 30, "hr1": 31}.get
    refill.remember(["a0"], ["ha0"])
    refill.observe(True)
    refill.observe(False)
    assert refill.observe(True)
    assert refill.take() == [("r0", 30), ("r1", 31), ("a0", 10)]


def _refill(per_step: int = 3) -> tuple[HbmRefill, Clock, dict[str, int]]:
    clock = Clock()
    refill = HbmRefill(per_step=per_step, clock=clock, wall=lambda: 0.0)
    cache = {"ha0": 10, "ha1": 11, "hb0": 20, "hb1": 21, "hb2": 22}  # vLLM's prefix cache
    refill.resolve = cache.get
    refill.remember(["a0", "a1"], ["ha0", "ha1"])
    refill.remember(["b0", "b1", "b2", "b3"], ["hb0", "hb1", "hb2", "hb3"])  # b3 evicted
    return refill, clock, cache


def test_after_an_outage_what_vllm_still_caches_is_handed_out_most_recent_first() -> None:
    """Before: nothing re-saved a chunk until a request touched it (run G: 54.7 s)."""
    refill, clock, _ = _refill()
    assert not refill.observe(True) and refill.take() == []  # never away: nothing due
    assert not refill.observe(False)
    clock.now += 5
    assert refill.observe(True)  # back
    clock.now += 1
    assert refill.take() == [("b0", 20), ("b1", 21), ("b2", 22)]  # a prefix's first chunk first
    refill.done_step(2, 1)
    assert refill.sweeping
    # b3 is no longer in vLLM's cache; a1's block is being loaded this step: neither read
    assert refill.take(skip_blocks={11}) == [("a0", 10)]
    refill.done_step(1, 0)
    assert refill.sweeping and refill.take() == []  # a second pass, once the gap has passed
    clock.now += refill.gap
    assert [d for d, _ in refill.take()] == ["b0", "b1", "b2"]
    refill.done_step(0, 3)
    refill.take()
    refill.done_step(0, 1)  # every put of the first pass landed: done
    assert not refill.sweeping and refill.timeline is None
    assert refill.last_line.endswith(
        "back at +5.0 s, re-save started +6.0 s, 3 of 6 remembered chunks re-saved (1 still in "
        "the pool, 2 no longer in vLLM's cache), 2 pass(es) (the later ones re-saved 0 whose "
        "puts had not landed), done at +11.0 s")


def test_away_again_mid_sweep_ends_it_and_the_next_return_starts_over() -> None:
    refill, clock, _ = _refill(per_step=2)
    refill.observe(True)
    refill.observe(False)
    refill.observe(True)
    assert [d for d, _ in refill.take()] == ["b0", "b1"]
    refill.done_step(2, 0)
    assert not refill.observe(False)
    assert "interrupted" in refill.last_line and not refill.sweeping
    assert refill.observe(True)
    assert [d for d, _ in refill.take()] == ["b0", "b1"]  # everything is due again


def test_without_access_to_vllms_cache_nothing_is_due() -> None:
    refill = HbmRefill(clock=Clock(), wall=lambda: 0.0)
    refill.remember(["a0"], ["ha0"])
    refill.observe(True)
    refill.observe(False)
    assert refill.observe(True) and not refill.sweeping and refill.take() == []
    assert "no access to vLLM's prefix cache" in refill.last_line


def test_a_pool_away_since_start_has_nothing_to_refill() -> None:
    refill, _, _ = _refill()
    assert not refill.observe(False) and not refill.observe(True) and not refill.sweeping


def test_cached_block_reads_vllms_block_pool() -> None:
    class Block:
        def __init__(self, block_id: int, is_null: bool = False) -> None:
            self.block_id, self.is_null = block_id, is_null

    class BlockPool:
        def get_cached_block(self, block_hash: str, groups: list[int]) -> list[Block] | None:
            assert groups == [0]
            return {"h": [Block(7)], "null": [Block(0, True)]}.get(block_hash)

    resolve = cached_block(BlockPool())
    assert resolve("h") == 7 and resolve("null") is None and resolve("gone") is None


def test_the_connector_binds_vllms_cache_only_where_a_block_hash_is_one_chunk() -> None:
    """vLLM hashing blocks of another size than our chunks would pair chunk i with another
    block's hash: the refill would read the wrong block, so it is not bound at all."""
    from mooncake_vllm.v1.connector import MooncakeStoreConnector

    for hash_block_size, bound in ((16, True), (8, False)):
        refill = HbmRefill()
        side = SimpleNamespace(scheduler=SimpleNamespace(block_size=16, refill=refill), can_save=True)
        MooncakeStoreConnector.bind_gpu_block_pool(side, SimpleNamespace(  # type: ignore[arg-type]
            hash_block_size=hash_block_size, get_cached_block=lambda h, g: None))
        assert (refill.resolve is not None) == bound


def test_a_loss_while_the_pool_stays_up_sweeps_as_after_an_outage_at_most_once_per_gap() -> None:
    """HbmRefill.lost: the outage's sweep, started while the pool answers (a holder's segment
    dropped); refused while the pool is away (the outage's sweep follows), taken without a
    new sweep while one runs, rate-limited to one start per LOSS_GAP."""
    refill, clock, _ = _refill(per_step=10)
    refill.observe(True)
    assert refill.lost("a lookup missed 4 chunks") and refill.sweeping
    assert refill.timeline is not None and refill.timeline.back_at == clock.now
    first = refill.timeline
    assert refill.lost("again") and refill.timeline is first  # one runs: taken, nothing new
    assert sorted(b for _, b in refill.take()) == [10, 11, 20, 21, 22]
    refill.done_step(0, 5)  # all still there: done
    assert not refill.sweeping
    assert "blocks lost while the pool stayed up (a lookup missed 4 chunks) at" in refill.last_line
    assert "0 of 6 remembered chunks re-saved (5 still in the pool, 1 no longer in" in refill.last_line
    clock.now += LOSS_GAP - 1
    assert not refill.lost("soon after") and not refill.sweeping
    clock.now += 1
    assert refill.lost("later") and refill.sweeping
    refill.observe(False)  # the pool goes away mid-sweep: the outage takes over
    assert "interrupted" in refill.last_line
    clock.now += LOSS_GAP
    assert not refill.lost("while away")
    refill.resolve = None
    refill.observe(True)
    assert refill.lost("no cache to read") and not refill.sweeping
