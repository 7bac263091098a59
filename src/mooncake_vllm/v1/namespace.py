"""Key namespaces for the V1 connector, derived from the vLLM config alone.

The scheduler process never sees a KV tensor, yet it must compute the same keys
the workers store under. Both sides therefore derive the layout fingerprint from
the config with :func:`expected_layout`; the worker then checks it against the
real tensors (:func:`check_layout`), so a wrong prediction fails loudly at start
instead of silently missing.

For MLA models every TP rank holds the same latent KV: the namespace then names
no TP rank (:func:`tp_shared`), rank 0 stores each block once and every rank
loads it.

Request-level facts (LoRA, cache salt, multimodal hashes) become
:class:`~mooncake_vllm.keys.RequestExtras` with :func:`request_extras`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.compat.facts import installed_facts
from mooncake_vllm.errors import UnsupportedVersionError
from mooncake_vllm.keys import KeyNamespace, RequestExtras
from mooncake_vllm.layout import BlockLayout, bytes_kind, layout_fingerprint
from mooncake_vllm.settings import ConnectorSettings
from mooncake_vllm.v1.layout_prediction import gpu_layout_name, predict_block

__all__ = [
    "ExpectedLayout",
    "RankNamespaces",
    "block_hashes",
    "check_layout",
    "expected_layout",
    "leading",
    "rank_namespaces",
    "request_extras",
    "tp_shared",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpectedLayout:
    """What one rank's KV blocks look like, predicted from the config."""

    kind: str
    variant: str
    dtype: str
    num_layers: int
    block_shape: tuple[int, ...]
    #: memory runs heads before tokens inside a block (HND, LBHNC/BLHNC)
    heads_first: bool = False
    #: MLA: one latent per token, the same on every TP rank
    mla: bool = False

    @property
    def fingerprint(self) -> str:
        return layout_fingerprint(bytes_kind(self.kind, self.heads_first), self.dtype,
                                  self.num_layers, self.block_shape, self.variant)


def _dtype_name(vllm_config: Any) -> str:
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto"
    if cache_dtype == "auto":
        return model_dtype
    # fp8 and friends: name the torch dtype vLLM allocates (uint8 for every fp8 flavour:
    # the backends view it as float8 inside their kernels)
    for module in ("vllm.utils.torch_utils", "vllm.utils"):
        try:
            table = importlib.import_module(module).STR_DTYPE_TO_TORCH_DTYPE
            return str(table[cache_dtype]).removeprefix("torch.")
        except (ImportError, AttributeError, KeyError):
            continue
    if str(cache_dtype).startswith("fp8"):
        return "uint8"
    return str(cache_dtype)


def _is_cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - no platform detected: not a CPU build
        return False


def _cpu_isa(vllm_config: Any, block_size: int, head_size: int) -> str:
    """The CPU attention ISA: it decides how K is packed inside a block."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(vllm_config.model_config.dtype, block_size, head_size,
                                 vllm_config.cache_config.cache_dtype))
    except Exception:  # noqa: BLE001 - older vLLM: one packing per platform
        return ""


def _cpu_page_kind() -> str:
    """How vLLM's CPU backend (up to 0.11.0) orders a block's page: IPEX's
    ``[H, N, D]`` pages or PagedAttention's (K split in ``x``-wide vectors), as vLLM
    itself decides (``_use_ipex``)."""
    for module in ("vllm.v1.attention.backends.cpu_attn", "vllm.attention.ops.ipex_attn"):
        try:
            use_ipex = importlib.import_module(module)._use_ipex
        except (ImportError, AttributeError):
            continue
        return "cpu-ipex" if use_ipex else "cpu-paged"
    return "cpu-ipex"  # 0.9.x: the V1 CPU backend always uses ipex_attn's pages


def _total_layers(model_config: Any) -> int:
    """The model's hidden layers over all pipeline stages."""
    method = getattr(model_config, "get_total_num_hidden_layers", None)
    if method is not None:
        return int(method())
    # vLLM <= 0.11 has no such method; its own get_layers_start_end_indices reads this field
    return int(getattr(model_config.hf_text_config, "num_hidden_layers", 0))


def _layer_count(vllm_config: Any, pp_rank: int) -> int:
    model_config = vllm_config.model_config
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    total = _total_layers(model_config)
    if pp_size == 1:
        return int(total)
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(total, pp_rank, pp_size)
    return end - start


def expected_layout(vllm_config: Any, pp_rank: int = 0, *,
                    variant: str | None = None, required: str | None = None) -> ExpectedLayout:
    """Predict the KV block layout of pipeline stage ``pp_rank`` from the config;
    ``variant`` (``layout_variant`` of the settings) overrides the variant tag;
    ``required``: the layout the engine's connector asks vLLM for (ours nested in a
    ``MultiConnector``: the parent's wish, :func:`~mooncake_vllm.v1.nesting.required_layout`)."""
    model_config = vllm_config.model_config
    block_size = int(vllm_config.cache_config.block_size)
    head_size = int(model_config.get_head_size())
    heads = int(model_config.get_num_kv_heads(vllm_config.parallel_config))
    layers = _layer_count(vllm_config, pp_rank)
    dtype = _dtype_name(vllm_config)
    heads_first = False
    use_mla = bool(getattr(model_config, "use_mla", False))
    cpu_kv = _is_cpu_platform() and not use_mla
    cpu_view = installed_facts(strict=True).cpu_kv_view if cpu_kv else None
    if cpu_view == "2bflat":
        # [2, B, N*H*D]: a K page and a V page per block, ordered as the page kind says
        kind, predicted = "cpu-paged", _cpu_page_kind()
        shape: tuple[int, ...] = (2, block_size * heads * head_size)
    elif cpu_view == "2bhnd":
        # [2, B, H, N, D]: K and V apart, heads first; "cpu" keeps it apart from a GPU's HND
        isa = _cpu_isa(vllm_config, block_size, head_size)
        kind, predicted = "cpu-hnd", "cpu" + (f"-{isa}" if isa else "")
        heads_first = heads > 1 and block_size > 1
        shape = (2, block_size, heads, head_size)
    elif cpu_kv:  # "bhnc"
        kind, predicted = "cpu", _cpu_isa(vllm_config, block_size, head_size)
        shape = (heads, block_size, 2 * head_size)
    else:  # GPU, or MLA anywhere (the CPU MLA backend keeps the generic latent layout)
        facts = installed_facts(strict=True)
        name = gpu_layout_name(vllm_config, facts, required=required)
        kind, heads_first, shape = predict_block(
            facts, name, use_mla=use_mla, heads=heads, head_size=head_size,
            block_size=block_size)
        predicted = ""
    return ExpectedLayout(kind, predicted if variant is None else variant, dtype, layers, shape,
                          heads_first, use_mla)


def check_layout(expected: ExpectedLayout, actual: BlockLayout) -> None:
    """Raise if the worker's real KV tensors differ from what the scheduler keys by."""
    if actual.fingerprint != expected.fingerprint:
        raise UnsupportedVersionError(
            f"MooncakeStoreConnector: the KV cache vLLM allocated has layout "
            f"{actual.fingerprint!r}, but the layout predicted from the config (which the "
            f"scheduler keys blocks by) is {expected.fingerprint!r}; this vLLM build lays "
            f"out KV differently than mooncake-vllm knows. Fix: report it, or set "
            f"kv_connector_extra_config['layout_variant'] only if the difference is the "
            f"variant tag")


@dataclass(frozen=True)
class RankNamespaces:
    """The namespace of every (tp, pp) rank of one engine, rank-major order; one per
    pipeline stage where the TP ranks share their keys (MLA, :func:`tp_shared`)."""

    namespaces: tuple[KeyNamespace, ...]

    def keys_for(self, digests_hex: Sequence[str]) -> list[str]:
        """Every rank's key of every chunk: ``[rank0 chunk0.., rank1 chunk0..]``."""
        prefixes = [ns.prefix() for ns in self.namespaces]
        return [f"{p}/{d}" for p in prefixes for d in digests_hex]

    def chunks_present(self, present: Sequence[bool], num_chunks: int) -> list[bool]:
        """Per chunk, whether EVERY rank's key is present, from :meth:`keys_for` order."""
        ranks = len(self.namespaces)
        return [all(present[r * num_chunks + j] for r in range(ranks)) for j in range(num_chunks)]


def leading(found: Sequence[bool]) -> int:
    """How many leading chunks of per-chunk presence (:meth:`RankNamespaces.chunks_present`) are there."""
    return next((j for j, here in enumerate(found) if not here), len(found))


def rank_namespaces(vllm_config: Any, settings: ConnectorSettings, *, tenant: str = "",
                    only: tuple[int, int] | None = None,
                    required: str | None = None) -> RankNamespaces:
    """Namespaces of all TP×PP ranks (or of the one ``(tp_rank, pp_rank)``);
    ``tenant`` is the Mooncake config's ``tenant_id``; the settings' ``cache_prefix`` joins too."""
    parallel = vllm_config.parallel_config
    tp_size = int(parallel.tensor_parallel_size)
    pp_size = int(parallel.pipeline_parallel_size)
    block_size = int(vllm_config.cache_config.block_size)
    out: list[KeyNamespace] = []
    for pp in range(pp_size):
        layout = expected_layout(vllm_config, pp, variant=settings.layout_variant,
                                 required=required)
        shared = tp_shared(vllm_config, layout)
        for tp in range(tp_size):
            if only is not None and only != (tp, pp):
                continue
            if only is None and shared and tp > 0:
                continue  # one namespace for the whole stage: rank 0's keys are every rank's
            out.append(KeyNamespace(model_id=settings.model_id, dtype=layout.dtype,
                                    layout=layout.fingerprint, block_size=block_size,
                                    tp_rank=tp, tp_size=tp_size, pp_rank=pp, tenant=tenant,
                                    cache_prefix=settings.cache_prefix, tp_shared=shared))
    return RankNamespaces(tuple(out))


def tp_shared(vllm_config: Any, layout: ExpectedLayout) -> bool:
    """Whether every TP rank of a stage holds the same KV bytes: MLA's latent cache is
    replicated on every TP rank, unless decode/prefill context parallelism shards it."""
    parallel = vllm_config.parallel_config
    sharded = any(int(getattr(parallel, name, 1) or 1) > 1 for name in
                  ("decode_context_parallel_size", "prefill_context_parallel_size"))
    return layout.mla and not sharded


def block_hashes(request: Any) -> Sequence[Any]:
    """vLLM's prefix-cache hashes of a ``Request``'s full blocks (none where the release or
    its config computes none)."""
    return getattr(request, "block_hashes", None) or ()


def request_extras(request: Any) -> RequestExtras:
    """LoRA name, cache salt and multimodal hashes of a vLLM ``Request``."""
    lora = getattr(request, "lora_request", None)
    lora_name = getattr(lora, "lora_name", None) if lora is not None else None
    mm: list[tuple[int, int, str]] = []
    for feature in getattr(request, "mm_features", None) or ():
        pos = getattr(feature, "mm_position", None)
        ident = getattr(feature, "mm_hash", None) or getattr(feature, "identifier", None)
        if pos is not None and ident is not None:
            mm.append((int(pos.offset), int(pos.length), str(ident)))
    return RequestExtras(lora_name=lora_name, cache_salt=getattr(request, "cache_salt", None),
                         mm_hashes=tuple(mm))
