"""What the V0 connector needs from one V0 batch, and the V0 "tail" value.

A V0 prefill batch (``ModelInputForGPUWithSamplingMetadata``) packs every
sequence's tokens back to back in ``input_tokens``; ``attn_metadata.slot_mapping``
gives each token's slot (``block * block_size + offset``) in the paged KV cache.
:func:`prefill_spans` turns that into one :class:`SeqSpan` per prefill sequence,
with the physical block of each FULL chunk. Sequences that do not start at
token 0 (prefix-cached or chunked prefill) cannot be keyed by their whole prompt
and are marked ``keyable=False``: never saved, never served from the pool.

The tail (:class:`Tail`) carries what a V0 runner needs beyond the full blocks
to skip the forward pass: the KV of the last partial block's tokens and the
final hidden state of the prompt. It is one small value per prompt.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from mooncake_vllm.keys import KeyNamespace, chunk_digests

__all__ = ["SeqSpan", "Tail", "prefill_spans", "tail_key"]

_TAIL_MAGIC = b"MCV0TAIL"


@dataclass(frozen=True)
class SeqSpan:
    """One prefill sequence of a V0 batch."""

    index: int  #: position among the batch's sequences
    start: int  #: first token in ``input_tokens``
    end: int  #: one past its last token
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]  #: physical block of each full chunk
    tail_slots: tuple[int, ...]  #: slots of the tokens after the last full chunk
    keyable: bool  #: starts at token 0 with slots laid out block by block

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(v) for v in value]


def prefill_spans(model_input: Any, block_size: int) -> list[SeqSpan]:
    """The prefill sequences of ``model_input`` (decode tokens, if any, are left out)."""
    meta = model_input.attn_metadata
    seq_lens = _as_list(getattr(meta, "seq_lens", None))
    if not seq_lens:
        seq_lens = _as_list(getattr(model_input, "seq_lens", None))
    query_lens = _as_list(getattr(model_input, "query_lens", None)) or list(seq_lens)
    context = _as_list(getattr(meta, "context_lens_tensor", None)) or [0] * len(seq_lens)
    num_prefills = int(getattr(meta, "num_prefills", len(seq_lens)))
    tokens = _as_list(model_input.input_tokens)
    slots = _as_list(meta.slot_mapping)
    spans: list[SeqSpan] = []
    start = 0
    for i in range(num_prefills):
        qlen = query_lens[i]
        end = start + qlen
        seq_tokens = tuple(tokens[start:end])
        seq_slots = slots[start:end]
        full = qlen // block_size
        block_ids: list[int] = []
        keyable = context[i] == 0 and qlen == seq_lens[i] and len(seq_slots) == qlen
        for j in range(full if keyable else 0):
            chunk = seq_slots[j * block_size:(j + 1) * block_size]
            block = chunk[0] // block_size
            if chunk != list(range(block * block_size, (block + 1) * block_size)):
                keyable = False  # not one whole physical block: never key it
                break
            block_ids.append(block)
        spans.append(SeqSpan(i, start, end, seq_tokens, tuple(block_ids) if keyable else (),
                             tuple(seq_slots[full * block_size:]) if keyable else (), keyable))
        start = end
    return spans


def tail_key(ns: KeyNamespace, tokens: tuple[int, ...]) -> str:
    """Key of a prompt's tail value: the namespace plus a digest of the whole prompt."""
    (whole,) = chunk_digests(tokens, len(tokens))
    return f"{ns.prefix()}/tail/{whole.hex()}"


@dataclass
class Tail:
    """KV of the tokens after the last full block, per layer, plus the final hidden state."""

    keys: torch.Tensor  #: [layers, n, heads, head_size]
    values: torch.Tensor  #: [layers, n, heads, head_size]
    hidden: torch.Tensor  #: [hidden_size]

    @classmethod
    def gather(cls, kv_caches: list[torch.Tensor], slots: tuple[int, ...],
               hidden: torch.Tensor) -> Tail:
        """Copy the tail tokens' K/V out of flash-layout caches ``[2, nb, bs, H, D]``."""
        index = torch.tensor(slots, dtype=torch.long, device=kv_caches[0].device)
        ks, vs = [], []
        for kv in kv_caches:
            flat = kv.view(2, -1, *kv.shape[3:])  # [2, nb*bs, H, D]
            ks.append(flat[0].index_select(0, index))
            vs.append(flat[1].index_select(0, index))
        return cls(torch.stack(ks), torch.stack(vs), hidden.detach().reshape(-1))

    def scatter(self, kv_caches: list[torch.Tensor], slots: tuple[int, ...]) -> None:
        """Write the tail tokens' K/V into ``slots`` of the consumer's caches."""
        index = torch.tensor(slots, dtype=torch.long, device=kv_caches[0].device)
        for layer, kv in enumerate(kv_caches):
            flat = kv.view(2, -1, *kv.shape[3:])
            flat[0].index_copy_(0, index, self.keys[layer].to(kv.device, kv.dtype))
            flat[1].index_copy_(0, index, self.values[layer].to(kv.device, kv.dtype))

    def pack(self) -> bytes:
        """``magic || u32 header length || JSON header || K bytes || V bytes || hidden bytes``."""
        parts = [t.detach().cpu().contiguous() for t in (self.keys, self.values, self.hidden)]
        head = json.dumps({"shapes": [list(p.shape) for p in parts],
                           "dtypes": [str(p.dtype).removeprefix("torch.") for p in parts]}).encode()
        body = b"".join(p.view(torch.uint8).numpy().tobytes() if p.numel() else b"" for p in parts)
        return _TAIL_MAGIC + struct.pack("<I", len(head)) + head + body

    @classmethod
    def unpack(cls, data: bytes) -> Tail | None:
        """Parse :meth:`pack` output; ``None`` if it is not a well-formed tail."""
        try:
            if not data.startswith(_TAIL_MAGIC):
                return None
            (hlen,) = struct.unpack_from("<I", data, len(_TAIL_MAGIC))
            pos = len(_TAIL_MAGIC) + 4
            head = json.loads(data[pos:pos + hlen])
            pos += hlen
            tensors = []
            for shape, dtype in zip(head["shapes"], head["dtypes"]):
                dt = getattr(torch, dtype)
                count = 1
                for n in shape:
                    count *= n
                nbytes = count * torch.empty((), dtype=dt).element_size()
                raw = bytearray(data[pos:pos + nbytes])
                if len(raw) != nbytes:
                    return None
                t = torch.frombuffer(raw, dtype=dt) if nbytes else torch.empty(0, dtype=dt)
                tensors.append(t.reshape(shape))
                pos += nbytes
            if pos != len(data) or len(tensors) != 3:
                return None
            return cls(*tensors)
        except (ValueError, KeyError, TypeError, AttributeError, struct.error):
            return None

    def fits(self, kv_caches: list[torch.Tensor], slots: tuple[int, ...]) -> bool:
        """Whether this tail matches the consumer's layer count, heads, head size and length."""
        kv = kv_caches[0]
        return (self.keys.shape[0] == len(kv_caches) and self.keys.shape[1] == len(slots)
                and tuple(self.keys.shape[2:]) == tuple(kv.shape[3:])
                and self.values.shape == self.keys.shape)
