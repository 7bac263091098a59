"""Which KV cache groups a model has, and whether the connector can serve them.

The connector stores ONE group of per-layer pages per block: every layer of the
model, full attention (or MLA), block ids from the request's first block table.
Hybrid models have more: sliding-window layers (their old blocks are freed and
replaced by vLLM's null block), Mamba / linear-attention layers (one running
state per request, no per-token pages), cross attention. Loading a stored
block into such a group, or saving the null block under a chunk key, would
serve wrong KV. So a model whose KV is anything but one full-attention group is
refused at start, with its groups named.

What vLLM turns into one group: the connector is no ``SupportsHMA`` connector,
so vLLM switches its hybrid KV cache manager off (fact ``connector_hma``), and
a model mixing full attention with sliding-window or chunked-local layers gets
full-attention pages for all of them (the window still applies to compute):
one full-attention group, served with token-identical results. A model whose
layers are ALL sliding-window stays one sliding-window group; Mamba hybrids
keep their state groups (or vLLM itself fails to unify them).

Where vLLM hands the connector its ``kv_cache_config`` (fact ``v1_ctor_args``
up to 3) :func:`check_kv_cache_config` reads the groups at construction, in the
scheduler and in every worker. Older releases give no config:
:func:`check_kv_caches` then judges the layers in ``register_kv_caches``
(their attention modules' sliding window, state tensors that are no single
tensor), before any block is stored or loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.errors import UnsupportedModelError

__all__ = [
    "SUPPORTED_SPECS",
    "GroupInfo",
    "check_kv_cache_config",
    "check_kv_caches",
    "describe_groups",
]

#: KV cache spec classes (exact names: subclasses change the semantics) a group may have
SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_UNIFORM = "UniformTypeKVCacheSpecs"
_SHOWN_LAYERS = 2


@dataclass(frozen=True)
class GroupInfo:
    """One KV cache group, as the error message names it."""

    index: int
    spec: str  #: spec class name (for a uniform-type group: its layers' spec names)
    layers: tuple[str, ...]
    window: int | None = None  #: sliding window or attention chunk, tokens
    supported: bool = True

    def describe(self) -> str:
        shown = ", ".join(self.layers[:_SHOWN_LAYERS])
        more = f", +{len(self.layers) - _SHOWN_LAYERS} more" if len(self.layers) > _SHOWN_LAYERS else ""
        window = f", window {self.window}" if self.window else ""
        return f"group {self.index}: {self.spec}{window}, {len(self.layers)} layer(s) ({shown}{more})"


def _spec_names(spec: Any) -> tuple[str, ...]:
    name = type(spec).__name__
    if name == _UNIFORM:
        inner = getattr(spec, "kv_cache_specs", None) or {}
        return tuple(sorted({type(s).__name__ for s in inner.values()})) or (name,)
    return (name,)


def _window(spec: Any) -> int | None:
    for attr in ("sliding_window", "attention_chunk_size"):
        value = getattr(spec, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def describe_groups(kv_cache_config: Any) -> list[GroupInfo]:
    """The groups of vLLM's ``KVCacheConfig``, each judged supported or not."""
    out = []
    for i, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        names = _spec_names(spec)
        out.append(GroupInfo(i, "+".join(names), tuple(group.layer_names), _window(spec),
                             all(n in SUPPORTED_SPECS for n in names)))
    return out


def _refuse(model: str, groups: list[str], why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"MooncakeStoreConnector cannot serve model {model!r}: {why}. Its KV cache: "
        f"{'; '.join(groups) or 'no KV cache layers'}. mooncake-vllm stores one group of "
        f"full-attention (or MLA) layers and never loads KV into another kind of group "
        f"(sliding-window, Mamba / linear-attention state, cross attention). Fix: serve this "
        f"model without --kv-transfer-config, or use a model whose layers are all full "
        f"attention (models mixing full and sliding-window layers are fine: vLLM gives them "
        f"one full-attention group)")


def check_kv_cache_config(kv_cache_config: Any, *, model: str) -> None:
    """Refuse a ``KVCacheConfig`` that is not exactly one full-attention (or MLA) group."""
    groups = describe_groups(kv_cache_config)
    text = [g.describe() for g in groups]
    if not groups:
        raise _refuse(model, text, "the model has no KV cache (attention-free)")
    if len(groups) > 1:
        raise _refuse(model, text, f"it has {len(groups)} KV cache groups (a hybrid model)")
    if not groups[0].supported:
        raise _refuse(model, text, f"its KV cache group is {groups[0].spec}")


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "data_ptr") or hasattr(value, "__array_interface__")


def check_kv_caches(kv_caches: Mapping[str, Any], vllm_config: Any, *, model: str) -> None:
    """Releases without a ``KVCacheConfig`` for connectors: judge the layers vLLM allocated.

    Each layer's module comes from vLLM's ``compilation_config.static_forward_context``.
    A layer whose cache is no single tensor holds a state (Mamba); one whose
    module has a sliding window is a sliding-window layer, fine only next to
    full-attention layers (vLLM then allocates full-attention pages for it, fact
    ``connector_hma``).
    """
    compilation = getattr(vllm_config, "compilation_config", None)
    forward_context = getattr(compilation, "static_forward_context", None) or {}
    full, windowed, state = [], [], []
    for name, value in kv_caches.items():
        module = forward_context.get(name)
        if not _is_tensor(value):
            state.append(name)
        elif _window(module) is not None:
            windowed.append(name)
        else:
            full.append(name)
    groups = [f"{kind}, {len(names)} layer(s) ({', '.join(names[:_SHOWN_LAYERS])}"
              f"{', ...' if len(names) > _SHOWN_LAYERS else ''})"
              for kind, names in (("full attention", full), ("sliding window", windowed),
                                  ("state (Mamba / linear attention)", state)) if names]
    if state:
        raise _refuse(model, groups, "some of its layers keep a state instead of KV pages")
    if windowed and not full:
        raise _refuse(model, groups, "all of its attention layers are sliding-window")
    if not full:
        raise _refuse(model, groups, "the model has no KV cache (attention-free)")
