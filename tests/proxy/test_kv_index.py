"""The kv_aware policy's pure logic: block indexes from KV events, prefix matching, cost."""

from __future__ import annotations

from mooncake_vllm.proxy.kv_index import LOCAL, POOL, POOL_MEDIUM, BlockIndex, CostWeights, choose, norm_hash


def _stored(hashes, medium="GPU", size=4):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": [], "block_size": size, "medium": medium}


def test_pool_medium_is_the_connectors() -> None:
    from mooncake_vllm.v1.events import POOL_MEDIUM as connector_medium

    assert POOL_MEDIUM == connector_medium


def test_bytes_and_int_hashes_normalise_alike() -> None:
    raw = bytes(range(32))
    assert norm_hash(raw) == int.from_bytes(raw, "big") & ((1 << 64) - 1) == norm_hash(norm_hash(raw))
    assert norm_hash(raw) != norm_hash(bytes(32))


def test_stored_removed_cleared_by_medium() -> None:
    idx = BlockIndex()
    assert idx.apply(0, [_stored([1, 2, 3]), _stored([1, 2], POOL_MEDIUM)]) is None
    assert idx.block_size == 4
    assert idx.prefix_blocks([1, 2, 3, 4], LOCAL) == 3
    assert idx.prefix_blocks([1, 2, 3], POOL) == 2
    assert idx.prefix_blocks([2, 3], LOCAL) == 2 and idx.prefix_blocks([9, 1], LOCAL) == 0
    idx.apply(1, [{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}])
    assert idx.prefix_blocks([1, 2, 3], LOCAL) == 1  # a hole ends the prefix
    assert idx.prefix_blocks([1, 2], POOL) == 2  # the pool still has it
    idx.apply(2, [{"type": "AllBlocksCleared"}])
    assert idx.prefix_blocks([1], LOCAL) == 0 and idx.prefix_blocks([1, 2], POOL) == 2
    assert len(idx) == 2


def test_sequence_gap_and_restart_drop_the_index() -> None:
    idx = BlockIndex()
    idx.apply(5, [_stored([1])])  # first batch seen: any number is fine
    assert idx.apply(6, [_stored([2])]) is None and len(idx) == 2
    assert idx.apply(8, [_stored([3])]) == "gap"
    assert idx.prefix_blocks([1], LOCAL) == 0 and idx.prefix_blocks([3], LOCAL) == 1
    assert idx.apply(0, []) == "restart" and len(idx) == 0
    assert idx.drops == {"gap": 1, "restart": 1}


def test_index_is_bounded_oldest_first() -> None:
    idx = BlockIndex(capacity=3)
    idx.apply(0, [_stored([1, 2, 3])])
    idx.apply(1, [_stored([1])])  # touched: now the newest
    idx.apply(2, [_stored([4])])
    assert len(idx) == 3
    assert idx.prefix_blocks([1], LOCAL) == 1 and idx.prefix_blocks([2], LOCAL) == 0


def test_garbage_events_are_ignored() -> None:
    idx = BlockIndex()
    idx.apply(0, [None, "x", {"type": "Nope"}, {"type": "BlockStored"}])
    assert len(idx) == 0


def test_longest_local_prefix_wins_at_equal_load() -> None:
    c = choose(1000, [0, 800, 200], 0, [1000, 1000, 1000])
    assert (c.index, c.local_tokens, c.pool_tokens, c.work) == (1, 800, 0, 200)


def test_pool_counts_the_same_everywhere() -> None:
    # all hold the prompt in the pool: equal prefill cost, so load decides
    c = choose(1000, [0, 0, 0], 1000, [2000, 0, 1000])
    assert (c.index, c.local_tokens, c.pool_tokens) == (1, 0, 1000)
    assert c.work == 300  # 1000 pool tokens at 0.3
    # local beats pool at equal load
    assert choose(1000, [0, 1000], 1000, [0, 0]).index == 1


def test_load_is_queued_work_so_one_hot_document_spreads() -> None:
    w = CostWeights(load=1.0)
    # the holder has 1500 tokens of prefill queued: recomputing 1000 elsewhere is sooner
    assert choose(1000, [1000, 0], 0, [1500, 0], weights=w).index == 1
    # queued requests that mostly hit cost little: the holder keeps the document
    assert choose(1000, [1000, 0], 0, [600, 0], weights=w).index == 0
    assert choose(1000, [1000, 0], 0, [0, 0], weights=w).index == 0


def test_ties_rotate_from_start() -> None:
    assert choose(100, [0, 0, 0], 0, [0, 0, 0], start=2).index == 2


def test_cost_is_over_each_candidates_measured_speed() -> None:
    # the same cold prompt: the twice-as-fast one wins until its queue is worth the difference
    assert choose(1000, [0, 0], 0, [0, 0], speeds=[1.0, 2.0]).index == 1
    assert choose(1000, [0, 0], 0, [0, 1800], speeds=[1.0, 2.0]).index == 1  # (1000 + 900) / 2 < 1000
    assert choose(1000, [0, 0], 0, [0, 2200], speeds=[1.0, 2.0]).index == 0  # (1000 + 1100) / 2 > 1000
    # a hit on the slow one still beats a recompute on the fast one
    assert choose(1000, [900, 0], 0, [0, 0], speeds=[0.5, 2.0]).index == 0
    assert choose(100, [0, 0, 0], 0, [0, 0, 0], start=1).index == 1


def test_a_recompute_costs_the_delay_it_imposes_on_the_requests_in_flight() -> None:
    # a cold prompt: the instance with less queued work but 3 requests in flight stalls all 3 for it
    assert choose(2000, [0, 0], 0, [0, 1000]).index == 0  # without in-flight counts: least queued
    c = choose(2000, [0, 0], 0, [0, 1000], inflight=[3, 0])
    assert c.index == 1 and c.cost == 2500  # 2000 + 0.5 * 1000; on 0: 2000 * (1 + 3)
    assert c.work == 2000  # the request's own work (queued there) is not the social cost
    # a hit's few tokens cost little wherever it lands: the busy holder keeps it
    assert choose(2100, [2000, 0], 0, [0, 0], inflight=[3, 0]).index == 0  # 100 * 4 < 2100
    # the multiplier weighs the prompt's work there, then the speed divides it all
    assert choose(1000, [0, 0], 0, [0, 0], speeds=[1.0, 2.0]).index == 1
    assert choose(1000, [0, 0], 0, [0, 0], speeds=[1.0, 2.0], inflight=[0, 2]).index == 0  # 1000 < 3000 / 2
    assert choose(1000, [0, 0], 0, [0, 0], weights=CostWeights(social=0.0), inflight=[0, 2]).index == 0  # tie
    assert choose(1000, [0, 0], 0, [0, 0], weights=CostWeights(social=0.0), inflight=[2, 0]).index == 0
