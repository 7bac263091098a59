"""Real vLLM V0 batch objects on CPU or CUDA tensors (for the V0 connector tests).

``device``: where the KV caches and the batch's tensors live. V0 runs only on GPUs,
so ``cuda`` is what a V0 deployment hands the connector; ``cpu`` lets CI run the
same tests without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch


def flash_caches(layers: int, num_blocks: int, block_size: int, heads: int, head: int,
                 *, fill: str = "zeros", seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> list[torch.Tensor]:
    """V0 FlashAttention-layout caches ``[2, num_blocks, block_size, heads, head]`` per layer."""
    shape = (2, num_blocks, block_size, heads, head)
    if fill == "zeros":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)
            for _ in range(layers)]


def prefill_input(prompts: Sequence[Sequence[int]], blocks: Sequence[Sequence[int]], block_size: int,
                  *, context_lens: Sequence[int] | None = None, device: str = "cpu") -> Any:
    """A real ``ModelInputForGPUWithSamplingMetadata`` + ``FlashAttentionMetadata`` prefill batch.

    ``blocks[i]`` lists the physical blocks of prompt ``i`` (its block table).
    """
    from vllm.attention.backends.flash_attn import FlashAttentionMetadata
    from vllm.worker.model_runner import ModelInputForGPUWithSamplingMetadata

    tokens: list[int] = []
    slots: list[int] = []
    positions: list[int] = []
    ctx = list(context_lens or [0] * len(prompts))
    for prompt, table, c in zip(prompts, blocks, ctx):
        for pos in range(c, len(prompt)):
            tokens.append(prompt[pos])
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    seq_lens = [len(p) for p in prompts]
    query_lens = [len(p) - c for p, c in zip(prompts, ctx)]
    width = max(len(t) for t in blocks)

    def on(values: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    table = on([list(t) + [0] * (width - len(t)) for t in blocks], torch.int32)
    qsl = on([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), torch.int32)
    ssl = on([0] + list(torch.tensor(seq_lens).cumsum(0).tolist()), torch.int32)
    meta = FlashAttentionMetadata(
        num_prefills=len(prompts), num_prefill_tokens=len(tokens), num_decode_tokens=0,
        slot_mapping=on(slots, torch.long), multi_modal_placeholder_index_maps=None,
        enable_kv_scales_calculation=False, seq_lens=seq_lens,
        seq_lens_tensor=on(seq_lens, torch.int32), max_prefill_seq_len=max(seq_lens),
        max_decode_seq_len=0, context_lens_tensor=on(ctx, torch.int32),
        block_tables=table, use_cuda_graph=False, max_query_len=max(query_lens),
        max_decode_query_len=0, query_start_loc=qsl, seq_start_loc=ssl)
    return ModelInputForGPUWithSamplingMetadata(
        input_tokens=on(tokens, torch.long),
        input_positions=on(positions, torch.long),
        seq_lens=seq_lens, query_lens=query_lens, attn_metadata=meta, is_prompt=True)


def v0_config(block_size: int, *, model: str = "/models/tiny-llama", tp_size: int = 1,
              role: str = "kv_both", extra: dict[str, Any] | None = None) -> Any:
    """The parts of a VllmConfig the V0 connector reads, with vLLM's REAL KVTransferConfig."""
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role=role,
                           kv_connector_extra_config=dict(extra or {}))
    return SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        model_config=SimpleNamespace(model=model, dtype=torch.float32))
