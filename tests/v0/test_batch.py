"""V0 batch parsing on REAL vLLM V0 batch objects, and the tail value format."""

from __future__ import annotations

import torch

from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.v0.batch import Tail, prefill_spans, tail_key

from .v0_inputs import flash_caches, prefill_input

BS = 16


def test_spans_map_full_chunks_to_physical_blocks() -> None:
    a, b = list(range(100, 140)), list(range(200, 216))
    spans = prefill_spans(prefill_input([a, b], [[7, 3, 9], [5]], BS), BS)
    assert [(s.start, s.end, s.keyable) for s in spans] == [(0, 40, True), (40, 56, True)]
    assert spans[0].block_ids == (7, 3) and spans[0].tokens == tuple(a)
    assert spans[0].tail_slots == tuple(9 * BS + i for i in range(8))
    assert spans[1].block_ids == (5,) and spans[1].tail_slots == ()


def test_prefix_cached_sequence_is_not_keyable() -> None:
    (span,) = prefill_spans(prefill_input([list(range(48))], [[1, 2, 3]], BS, context_lens=[16]), BS)
    assert span.keyable is False and span.block_ids == () and span.num_tokens == 32


def test_tail_roundtrip_and_damage() -> None:
    caches = flash_caches(2, 8, BS, 2, 4, fill="randn", seed=1)
    slots = (3 * BS + 0, 3 * BS + 1, 3 * BS + 2)
    tail = Tail.gather(caches, slots, torch.arange(6, dtype=torch.float32))
    raw = tail.pack()
    back = Tail.unpack(raw)
    assert back is not None and back.fits(caches, slots)
    assert torch.equal(back.keys, tail.keys) and torch.equal(back.hidden, tail.hidden)
    dst = flash_caches(2, 8, BS, 2, 4)
    back.scatter(dst, (BS * 5, BS * 5 + 1, BS * 5 + 2))
    assert torch.equal(dst[1][:, 5, :3], caches[1][:, 3, :3])
    assert Tail.unpack(raw[:-1]) is None and Tail.unpack(b"junk") is None
    assert not back.fits(caches, slots[:2])


def test_tail_key_depends_on_every_token_and_the_namespace() -> None:
    ns = KeyNamespace("m", "float32", "nhd:float32:L2:2x16x2x4", BS)
    other = KeyNamespace("m", "float32", "cpu:float32:L2:2x16x8", BS)
    assert tail_key(ns, (1, 2, 3)) != tail_key(ns, (1, 2, 4))
    assert tail_key(ns, (1, 2, 3)) != tail_key(other, (1, 2, 3))
    assert tail_key(ns, (1, 2, 3)).startswith(ns.prefix() + "/tail/")
