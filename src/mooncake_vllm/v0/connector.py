"""The V0 ``MooncakeStoreConnector`` (vLLM 0.8.3 - 0.10.0, ``VLLM_USE_V1=0``).

It stores KV in the SAME pool, under the SAME per-block keys
(:func:`~mooncake_vllm.keys.chunk_keys`) and value format
(:meth:`~mooncake_vllm.store.StoreClient.put_blocks`) as the V1 connector, so a
V0 producer warms a V1 consumer of the same model and layout.

* **send** (producer, after the forward pass): every full chunk of every prefill
  sequence goes to the pool straight from its physical block; one small *tail*
  value per prompt (:class:`~mooncake_vllm.v0.batch.Tail`: the partial last
  block's KV and the final hidden state) lets a V0 consumer skip the forward.
* **recv** (consumer, before the forward pass): the forward pass is bypassed
  only when EVERY sequence of the batch is fully covered (all chunk keys and the
  tail present and verified) and nothing needs more than the last token's hidden
  state; otherwise nothing is loaded and vLLM recomputes.

vLLM V0 caches are FlashAttention-layout tensors ``[2, num_blocks, block_size,
kv_heads, head_size]`` per layer (or MLA ``[num_blocks, block_size, dim]``: the
same latent on every TP rank, so keys name no TP rank and only TP rank 0 puts).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.logs import follow_vllm_logging
from mooncake_vllm.settings import ConnectorSettings
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.namespaces import register_namespaces
from mooncake_vllm.v0.batch import SeqSpan, Tail, prefill_spans, tail_key

__all__ = ["MooncakeStoreConnector"]

log = logging.getLogger(__name__)

#: V0 attention-metadata class name -> the KV layout kind its caches have.
_LAYOUT_BY_METADATA = {"FlashAttentionMetadata": "nhd", "MLACommonMetadata": "mla",
                       "FlashMLAMetadata": "mla", "TritonMLAMetadata": "mla"}


class MooncakeStoreConnector(KVConnectorBase):
    """V0 KV connector on the shared :class:`~mooncake_vllm.store.StoreClient`."""

    def __init__(self, rank: int, local_rank: int, config: Any,
                 store: StoreClient | None = None) -> None:
        follow_vllm_logging()
        self.config = config
        # validated exactly as on V1: a typo V1 rejects is rejected here too
        self.settings = settings = ConnectorSettings.from_vllm_config(config)
        parallel = config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        self.pp_size = int(parallel.pipeline_parallel_size)
        # vLLM ranks are TP-major inside a PP stage: rank = pp_rank * tp_size + tp_rank
        self.tp_rank = rank % self.tp_size
        self.pp_rank = (rank // self.tp_size) % self.pp_size
        self.local_rank = local_rank
        self.block_size = int(config.cache_config.block_size)
        self.model_id = settings.model_id
        self.variant = settings.layout_variant or ""
        self.gpu_path = settings.gpu_path
        self.store_clients = settings.clients_for_worker()
        # the same two sources as the V1 connector: extra_config's path, else $MOONCAKE_CONFIG_PATH
        self.store = store if store is not None else StoreClient.connect(
            load_store_config(settings.mooncake_config_path), timeout=settings.connect_timeout)
        self.tenant = self.store.config.tenant_id
        self.cache_prefix = settings.cache_prefix
        self._layout: BlockLayout | None = None
        self._layout_key: tuple[int, ...] = ()
        self.namespace: KeyNamespace | None = None
        self._skipped: set[str] = set()

    # ------------------------------------------------------------------ helpers
    def _bind(self, kv_caches: list[torch.Tensor], attn_metadata: Any) -> BlockLayout | None:
        """The block layout of ``kv_caches`` (registered once), or None if unsupported."""
        key = tuple(int(t.data_ptr()) for t in kv_caches)
        if self._layout is not None and key == self._layout_key:
            return self._layout
        kind = _LAYOUT_BY_METADATA.get(type(attn_metadata).__name__)
        if kind is None:
            self._skip(f"attention backend {type(attn_metadata).__name__} (only FlashAttention "
                       f"and MLA KV layouts are supported)")
            return None
        layout = BlockLayout.from_kv_caches(kv_caches, kind=kind, variant=self.variant)
        if layout.block_size != self.block_size:
            self._skip(f"KV block size {layout.block_size} != cache_config.block_size {self.block_size}")
            return None
        self.store.register_layout(layout, self.gpu_path, clients=self.store_clients)
        self._layout, self._layout_key = layout, key
        self.namespace = KeyNamespace(model_id=self.model_id, dtype=layout.dtype,
                                      layout=layout.fingerprint, block_size=layout.block_size,
                                      tp_rank=self.tp_rank, tp_size=self.tp_size,
                                      pp_rank=self.pp_rank, tenant=self.tenant,
                                      cache_prefix=self.cache_prefix,
                                      tp_shared=layout.kind == "mla")
        register_namespaces(self.store, [self.namespace], background=True)
        return layout

    def _skip(self, why: str) -> None:
        if why not in self._skipped:
            self._skipped.add(why)
            log.warning("mooncake-vllm V0: not using the pool for batches with %s", why)

    def _unsupported(self, model_input: Any) -> str | None:
        if getattr(model_input, "lora_requests", None):
            return "LoRA adapters"
        if getattr(model_input, "multi_modal_kwargs", None):
            return "multimodal inputs"
        if getattr(model_input, "inputs_embeds", None) is not None:
            return "prompt embeddings"
        return None

    # ------------------------------------------------------------------ send
    def send_kv_caches_and_hidden_states(self, model_executable: Any, model_input: Any,
                                         kv_caches: list[torch.Tensor],
                                         hidden_or_intermediate_states: Any) -> None:
        """Store the full blocks and the tail of every prefill sequence of the batch."""
        try:
            self._send(model_input, kv_caches, hidden_or_intermediate_states)
        except Exception:  # noqa: BLE001 - a failed save is a future miss, never a dead engine
            log.warning("mooncake-vllm V0: saving a batch failed; continuing", exc_info=True)

    def _send(self, model_input: Any, kv_caches: list[torch.Tensor],
              hidden_or_intermediate_states: Any) -> None:
        why = self._unsupported(model_input)
        if why:
            return self._skip(why)
        layout = self._bind(kv_caches, model_input.attn_metadata)
        if layout is None or self.namespace is None:
            return None
        hidden = hidden_or_intermediate_states if isinstance(
            hidden_or_intermediate_states, torch.Tensor) else None
        for span in prefill_spans(model_input, self.block_size):
            if not span.keyable or span.num_tokens == 0:
                continue
            keys = chunk_keys(self.namespace, span.tokens)
            if keys and self.namespace.stores:  # MLA: TP rank 0 stores for every rank
                self.store.put_blocks(keys, layout, list(span.block_ids),
                                      admission=self.settings.save_admission)
            if hidden is not None and layout.kind == "nhd":
                tail = Tail.gather(kv_caches, span.tail_slots, hidden[span.end - 1])
                self.store.put_value(tail_key(self.namespace, span.tokens), tail.pack())
        return None

    # ------------------------------------------------------------------ recv
    def recv_kv_caches_and_hidden_states(self, model_executable: Any, model_input: Any,
                                         kv_caches: list[torch.Tensor]) -> tuple[Any, bool, Any]:
        """Load every sequence and skip the forward pass, or load nothing and recompute."""
        try:
            return self._recv(model_input, kv_caches)
        except Exception:  # noqa: BLE001 - recompute rather than fail the request
            log.warning("mooncake-vllm V0: loading a batch failed; vLLM recomputes it", exc_info=True)
            return None, False, model_input

    def _recv(self, model_input: Any, kv_caches: list[torch.Tensor]) -> tuple[Any, bool, Any]:
        miss = (None, False, model_input)
        why = self._unsupported(model_input)
        if why:
            self._skip(why)
            return miss
        meta = model_input.attn_metadata
        if self.pp_size > 1 or int(getattr(meta, "num_decode_tokens", 0) or 0) > 0:
            return miss  # a bypass must cover every rank and every token of the batch
        if _needs_all_hidden_states(model_input):
            return miss
        layout = self._bind(kv_caches, meta)
        if layout is None or self.namespace is None or layout.kind != "nhd":
            return miss
        spans = prefill_spans(model_input, self.block_size)
        if not spans or not all(s.keyable for s in spans):
            return miss
        plans: list[tuple[SeqSpan, list[str], Tail]] = []
        for span in spans:
            keys = chunk_keys(self.namespace, span.tokens)
            # counted as V1 counts them: blocks found (hits) and not (misses)
            if keys and self.store.longest_prefix(keys) < len(keys):
                return miss
            raw = self.store.get_value(tail_key(self.namespace, span.tokens))
            tail = Tail.unpack(raw) if raw is not None else None
            if tail is None or not tail.fits(kv_caches, span.tail_slots):
                return miss
            plans.append((span, keys, tail))
        for span, keys, _tail in plans:
            if keys and not all(self.store.get_blocks(keys, layout, list(span.block_ids))):
                return miss  # what was written is recomputed by the forward pass
        num_tokens = int(model_input.input_tokens.shape[0])
        first = plans[0][2].hidden
        hidden = torch.zeros(num_tokens, first.shape[0], dtype=first.dtype,
                             device=kv_caches[0].device)
        for span, _keys, tail in plans:
            tail.scatter(kv_caches, span.tail_slots)
            hidden[span.end - 1] = tail.hidden.to(hidden.device, hidden.dtype)
        return hidden, True, model_input

    def close(self) -> None:
        """Close the pool client."""
        self.store.close()


def _needs_all_hidden_states(model_input: Any) -> bool:
    """True if sampling needs more than each sequence's last hidden state (prompt logprobs)."""
    sampling = getattr(model_input, "sampling_metadata", None)
    for group in getattr(sampling, "seq_groups", None) or ():
        params = getattr(group, "sampling_params", None)
        if params is not None and getattr(params, "prompt_logprobs", None) is not None:
            return True
    return False
