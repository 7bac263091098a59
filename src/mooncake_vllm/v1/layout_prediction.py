"""Which GPU KV-cache layout vLLM will hand the workers, decided from the config.

The scheduler never sees a KV tensor, so it names the bytes of a block from the
same inputs vLLM's own layout decision reads. Where that decision lives and
what it reads is per release (:class:`~mooncake_vllm.compat.versions.VllmFacts`
``kv_layout_source`` and friends); this module only follows those facts:

* ``None``: the runner allocates every backend's shape contiguously (NHD).
* ``connector-utils`` / ``backends-utils``: ``NHD`` or ``HND`` from, in vLLM's
  order, the Blackwell FlashInfer override, ``VLLM_KV_CACHE_LAYOUT``, the
  connector's required layout (ours asks for none: NHD).
* ``cache-config``: the engine core resolved one ``KVCacheLayout`` into
  ``cache_config.kv_cache_layout`` before any connector exists; views are
  ``[B, H, N, C]`` (kind ``hnc``).

The pure :func:`predict_block` turns the decision into a kind, a heads-first
flag and a block shape, mirroring :class:`~mooncake_vllm.layout.BlockLayout`.
"""

from __future__ import annotations

import os
from typing import Any

from mooncake_vllm.errors import UnsupportedVersionError

__all__ = [
    "LAYOUT_ALIASES",
    "LEGACY_NAMES",
    "SPLIT_PAGE_LAYOUTS",
    "gpu_layout_name",
    "predict_block",
]

#: legacy names vLLM accepts for the generic layouts
LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
#: the legacy name of a generic layout (a connector of a newer vLLM may ask by the generic one)
LEGACY_NAMES = {generic: legacy for legacy, generic in LAYOUT_ALIASES.items()}
#: generic layouts per whether memory runs heads before tokens inside a layer's page
_HEADS_FIRST = {"LBHNC": True, "BLHNC": True, "LBNHC": False, "BLNHC": False,
                # 0.27-0.28: the backends' [B, H, N, 2*D] per layer, NHD/HND by stride order
                "NHD": False, "HND": True}
#: generic layouts that split one layer's page of a block into several runs
SPLIT_PAGE_LAYOUTS = ("BHLNC", "LHBNC")


def _blackwell_flashinfer(vllm_config: Any) -> bool:
    """Whether FlashInfer on compute capability 10.x will force HND (0.10.0-0.2x)."""
    try:
        from vllm.platforms import current_platform

        capability = current_platform.get_device_capability()
    except Exception:  # noqa: BLE001 - no device: not Blackwell
        return False
    if capability is None or getattr(capability, "major", None) != 10:
        return False
    backend = os.environ.get("VLLM_ATTENTION_BACKEND")
    attention_config = getattr(vllm_config, "attention_config", None)
    configured = getattr(attention_config, "backend", None)
    if configured is not None:
        backend = str(getattr(configured, "name", configured))
    if backend:
        return "FLASHINFER" in backend.upper() and "MLA" not in backend.upper()
    try:  # the default backend on SM 10.x when FlashInfer is installed
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def gpu_layout_name(vllm_config: Any, facts: Any, *, env: Any = None,
                    required: str | None = None) -> str:
    """vLLM's layout name for this config: ``NHD``/``HND`` or a ``KVCacheLayout`` name;
    ``required``: what the engine's connector asks for (ours alone: nothing; inside a
    ``MultiConnector`` beside the P2P ``MooncakeConnector``: HND)."""
    env = os.environ if env is None else env
    source = facts.kv_layout_source
    if source is None:
        return "NHD"
    if source == "cache-config":
        name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
        if name is None:  # not resolved yet (never in a started engine): vLLM's default
            name = env.get("VLLM_KV_CACHE_LAYOUT") or "LBNHC"
        return LAYOUT_ALIASES.get(str(name), str(name))
    if facts.kv_layout_blackwell_flashinfer_hnd and _blackwell_flashinfer(vllm_config):
        return "HND"
    if facts.kv_layout_env and env.get("VLLM_KV_CACHE_LAYOUT"):
        return str(env["VLLM_KV_CACHE_LAYOUT"])
    # the connector's own wish: NixlConnector (connector-utils), the connector class's
    # get_required_kvcache_layout (backends-utils, 0.10.1+): ours asks for none, a parent
    # MultiConnector for its children's (the P2P MooncakeConnector: HND)
    if required:
        return LEGACY_NAMES.get(str(required), str(required))
    return "NHD"


def predict_block(facts: Any, layout_name: str, *, use_mla: bool, heads: int,
                  head_size: int, block_size: int) -> tuple[str, bool, tuple[int, ...]]:
    """``(tensor kind, heads_first, block_shape)`` of one layer's block on a GPU."""
    if facts.kv_view_shape == "bhnc":
        if layout_name in SPLIT_PAGE_LAYOUTS:
            raise UnsupportedVersionError(
                f"MooncakeStoreConnector: vLLM's KV cache layout {layout_name} splits one "
                f"layer's page of a block into several memory runs; mooncake-vllm stores "
                f"blocks as whole pages. Fix: set VLLM_KV_CACHE_LAYOUT to LBNHC (NHD), "
                f"LBHNC (HND), BLNHC or BLHNC")
        if layout_name not in _HEADS_FIRST:
            raise UnsupportedVersionError(
                f"MooncakeStoreConnector: unknown vLLM KV cache layout {layout_name!r}; "
                f"known: {', '.join((*_HEADS_FIRST, *SPLIT_PAGE_LAYOUTS))}")
        if use_mla and facts.kv_layout_source != "cache-config":
            return "mla", False, (block_size, head_size)  # 0.27-0.28: MLA keeps [B, N, head]
        if use_mla:  # one latent per token: [B, 1, N, head]
            return "hnc", True, (1, block_size, head_size)
        # C = K then V of one head and token; with one head or token the order is moot
        heads_first = _HEADS_FIRST[layout_name] or heads == 1 or block_size == 1
        return "hnc", heads_first, (heads, block_size, 2 * head_size)
    if use_mla:
        return "mla", False, (block_size, head_size)
    if layout_name not in ("NHD", "HND"):
        raise UnsupportedVersionError(
            f"MooncakeStoreConnector: unknown vLLM KV cache layout {layout_name!r} "
            f"(VLLM_KV_CACHE_LAYOUT); this release knows NHD and HND")
    heads_first = layout_name == "HND" and heads > 1 and block_size > 1
    return "nhd", heads_first, (2, block_size, heads, head_size)
