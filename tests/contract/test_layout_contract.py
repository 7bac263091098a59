"""Contract: the GPU KV layout we predict equals what this release's OWN code allocates.

No GPU needed: the backends' shape/stride functions are static, and the tensors are
allocated on the CPU the way the release's GPU model runner does it
(``_reshape_kv_cache_tensors``: allocate in stride order, permute back to the
logical shape; from the ``bhnc`` releases: ``allocate_kv_cache`` itself).
Each case builds a :class:`BlockLayout` from those tensors and compares its
fingerprint with :func:`predict_block` for NHD and HND (and every generic
``KVCacheLayout``), and checks the bytes: blocks of equal fingerprint hold the
same bytes for the same logical KV, whichever backend allocated them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
from types import SimpleNamespace

import pytest

from mooncake_vllm.compat import installed_vllm, vllm_facts
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.v1.layout_prediction import SPLIT_PAGE_LAYOUTS, gpu_layout_name, predict_block

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.contract

_DIST = installed_vllm()
if _DIST is None:  # pragma: no cover
    pytest.skip("no vLLM installed", allow_module_level=True)
FACTS = vllm_facts(_DIST.version)
NB, BS, HEADS, HEAD, LAYERS = 6, 16, 4, 32, 2
MLA_DIM = 72

_BACKENDS = {  # name -> (module, class); 5-dim (or 3-dim MLA) shape releases
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    "MLA": ("vllm.v1.attention.backends.mla.common", "MLACommonBackend"),
}


class _KernelStub(types.ModuleType):
    """Stands in for a GPU kernel package (flashinfer) the CPU env lacks: the shape and
    stride functions under test are static and never call into it."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        child = _KernelStub(f"{self.__name__}.{name}")
        sys.modules[child.__name__] = child
        return child

    def __call__(self, *args, **kwargs):
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _StubFinder:
    """Import hook: every ``flashinfer.*`` submodule is a stub while it is installed."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.startswith("flashinfer."):
            import importlib.machinery

            return importlib.machinery.ModuleSpec(name, _StubFinder, is_package=True)
        return None

    @staticmethod
    def create_module(spec):
        module = _KernelStub(spec.name)
        module.__path__ = []
        return module

    @staticmethod
    def exec_module(module):
        return None


def _backend(name: str):
    module, cls = _BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as exc:
        if exc.name != "flashinfer" or name != "FLASHINFER":
            pytest.skip(f"vLLM {_DIST.version} cannot import {module}.{cls}: {exc}")
        stubbed = [n for n in list(sys.modules) if n == "flashinfer" or n.startswith("flashinfer.")]
        root = _KernelStub("flashinfer")
        root.__path__ = []
        sys.modules["flashinfer"] = root
        sys.meta_path.insert(0, _StubFinder)
        try:
            return getattr(importlib.import_module(module), cls)
        except Exception as exc2:  # noqa: BLE001
            pytest.skip(f"vLLM {_DIST.version}: {module} needs flashinfer beyond a stub: "
                        f"{type(exc2).__name__}: {str(exc2)[:160]}")
        finally:
            sys.meta_path.remove(_StubFinder)
            for n in [n for n in list(sys.modules) if n == "flashinfer" or n.startswith("flashinfer.")]:
                if n not in stubbed:
                    del sys.modules[n]
    except Exception as exc:  # noqa: BLE001 - a release (or this CPU build) lacks it
        pytest.skip(f"vLLM {_DIST.version} cannot import {module}.{cls}: "
                    f"{type(exc).__name__}: {str(exc)[:160]}")


def _shape(backend, num_blocks: int, heads: int, head: int) -> tuple[int, ...]:
    fn = backend.get_kv_cache_shape
    params = inspect.signature(fn).parameters
    args = [num_blocks, BS, heads, head]
    if "cache_dtype_str" in params:
        args.append("auto")
    return tuple(fn(*args))


def _force_layout(monkeypatch, name: str | None) -> None:
    """Make vLLM's own layout decision return ``name`` (env, override and caches reset)."""
    if name is None:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", name)
    try:
        utils = importlib.import_module("vllm.v1.attention.backends.utils")
    except Exception:  # noqa: BLE001
        return
    if hasattr(utils, "_KV_CACHE_LAYOUT_OVERRIDE"):
        monkeypatch.setattr(utils, "_KV_CACHE_LAYOUT_OVERRIDE", None)
    fn = getattr(utils, "get_kv_cache_layout", None)
    if hasattr(fn, "cache_clear"):
        fn.cache_clear()
    # the connector's wish is read through the current config: none set, so NHD


@pytest.fixture(autouse=True)
def _close_contexts():
    yield
    try:
        fn = importlib.import_module("vllm.v1.attention.backends.utils").get_kv_cache_layout
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    except Exception:  # noqa: BLE001
        pass


def _allocate(backend, num_blocks: int, heads: int, head: int, dtype) -> torch.Tensor:
    """Mirror the V1 GPU runner's ``_reshape_kv_cache_tensors`` on the CPU."""
    shape = _shape(backend, num_blocks, heads, head)
    try:
        order = tuple(backend.get_kv_cache_stride_order())
        assert len(order) == len(shape)
    except (AttributeError, NotImplementedError):
        order = tuple(range(len(shape)))
    physical = tuple(shape[i] for i in order)
    inv = [order.index(i) for i in range(len(order))]
    numel = 1
    for n in shape:
        numel *= n
    raw = torch.zeros(numel * torch.empty((), dtype=dtype).element_size(), dtype=torch.int8)
    return raw.view(dtype).view(physical).permute(*inv)


def _fill(t: torch.Tensor, kind: str) -> None:
    """Write the same logical KV into any 5-dim tensor: value(kv, block, token, head, d)."""
    kv = torch.arange(2).view(2, 1, 1, 1, 1)
    b = torch.arange(t.shape[1] if kind == "nhd" else t.shape[0]).view(1, -1, 1, 1, 1)
    n = torch.arange(BS).view(1, 1, -1, 1, 1)
    h = torch.arange(HEADS).view(1, 1, 1, -1, 1)
    d = torch.arange(HEAD).view(1, 1, 1, 1, -1)
    value = ((((kv * 7 + b) * 31 + n) * 5 + h) * 37 + d) % 251
    if kind == "nhd":
        t.copy_(value.to(t.dtype))
    else:
        t.copy_(value.permute(1, 0, 2, 3, 4).to(t.dtype))


def _block_bytes(layout: BlockLayout, block: int) -> bytes:
    rows = layout.byte_views()
    return b"".join(bytes(r[s, block].contiguous().numpy()) for r in rows
                    for s in range(r.shape[0]))


def _predicted(name: str, *, use_mla: bool = False, heads: int = HEADS, head: int = HEAD,
               dtype: str = "bfloat16") -> str:
    from mooncake_vllm.layout import bytes_kind, layout_fingerprint

    kind, heads_first, shape = predict_block(FACTS, name, use_mla=use_mla, heads=heads,
                                             head_size=head, block_size=BS)
    return layout_fingerprint(bytes_kind(kind, heads_first), dtype, LAYERS, shape)


five_dim = pytest.mark.skipif(FACTS.kv_view_shape != "backend",
                              reason=f"vLLM {_DIST.version} hands [B, H, N, C] views")
#: the backends' own get_kv_cache_shape + stride order decide (5-dim, or from 0.27 the
#: packed [B, H, N, 2*D]); from 0.29 generic views of a resolved KVCacheLayout (below)
backend_shapes = pytest.mark.skipif(FACTS.kv_layout_source == "cache-config",
                                    reason=f"vLLM {_DIST.version} allocates generic views")


def _config_context(monkeypatch):
    """A current (default) vLLM config where the release's layout lookup asks for one
    (0.27+: the connector's wish is read through it). Where a default one cannot be built
    here (0.9.x: its CPU platform check needs a model), a stand-in with no KV transfer
    config, which is all the lookup reads (kv_connector.utils.get_kv_connector_cache_layout)."""
    import contextlib

    try:
        from vllm.config import VllmConfig, set_current_vllm_config

        return set_current_vllm_config(VllmConfig())
    except Exception:  # noqa: BLE001
        import vllm.config

        if hasattr(vllm.config, "_current_vllm_config"):
            monkeypatch.setattr(vllm.config, "_current_vllm_config",
                                SimpleNamespace(kv_transfer_config=None, model_config=None))
        return contextlib.nullcontext()


@backend_shapes
@pytest.mark.parametrize("requested", [None, "NHD", "HND"])
def test_vllms_own_layout_decision_matches_ours(monkeypatch, requested) -> None:
    _force_layout(monkeypatch, requested)
    config = SimpleNamespace(cache_config=SimpleNamespace(), attention_config=None)
    ours = gpu_layout_name(config, FACTS)
    if FACTS.kv_layout_source == "backends-utils":
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        with _config_context(monkeypatch):
            assert get_kv_cache_layout() == ours
    else:  # no VLLM_KV_CACHE_LAYOUT before 0.9.2: always NHD for our connector
        assert ours == "NHD"


@backend_shapes
@pytest.mark.parametrize("backend_name", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"])
@pytest.mark.parametrize("requested", ["NHD", "HND"])
def test_backend_tensor_matches_prediction(monkeypatch, backend_name, requested) -> None:
    backend = _backend(backend_name)
    _force_layout(monkeypatch, requested if FACTS.kv_layout_env else None)
    name = gpu_layout_name(SimpleNamespace(cache_config=SimpleNamespace(), attention_config=None),
                           FACTS, env=os.environ)
    kind = predict_block(FACTS, name, use_mla=False, heads=HEADS, head_size=HEAD,
                         block_size=BS)[0]
    tensors = [_allocate(backend, NB, HEADS, HEAD, torch.bfloat16) for _ in range(LAYERS)]
    layout = BlockLayout.from_kv_caches(tensors, kind=kind)  # what the worker passes
    try:  # packed [B, H, N, 2*D] releases: every backend permutes for NHD, none for HND
        honours = (FACTS.kv_view_shape == "bhnc"
                   or tuple(backend.get_kv_cache_stride_order()) != (0, 1, 2, 3, 4))
    except (AttributeError, NotImplementedError):
        honours = False
    if requested == "NHD" or honours or not FACTS.kv_layout_env:
        assert layout.fingerprint == _predicted(name)
    else:
        # a backend that ignores VLLM_KV_CACHE_LAYOUT=HND (Triton) stays NHD: the scheduler
        # cannot know the backend, so the worker's start check refuses it loudly
        from mooncake_vllm.errors import UnsupportedVersionError
        from mooncake_vllm.v1.namespace import ExpectedLayout, check_layout

        assert not layout.heads_first and name == "HND"
        kind, heads_first, shape = predict_block(FACTS, name, use_mla=False, heads=HEADS,
                                                 head_size=HEAD, block_size=BS)
        with pytest.raises(UnsupportedVersionError, match="layout"):
            check_layout(ExpectedLayout(kind, "", "bfloat16", LAYERS, shape, heads_first), layout)


@five_dim
@pytest.mark.parametrize("requested", ["NHD", "HND"])
def test_flashattention_and_flashinfer_blocks_are_byte_identical(monkeypatch, requested) -> None:
    fa, fi = _backend("FLASH_ATTN"), _backend("FLASHINFER")
    _force_layout(monkeypatch, requested if FACTS.kv_layout_env else None)
    layouts = []
    for backend in (fa, fi):
        t = _allocate(backend, NB, HEADS, HEAD, torch.float16)
        layout = BlockLayout.from_kv_caches([t], kind="nhd")
        _fill(t, layout.kind)
        layouts.append(layout)
    assert layouts[0].fingerprint == layouts[1].fingerprint
    for block in range(NB):
        assert _block_bytes(layouts[0], block) == _block_bytes(layouts[1], block)
    # and the bytes are the block in memory order: K page then V page, NHD or HND
    t = layouts[0].tensors[0]
    k = t[0, 2].permute(1, 0, 2) if layouts[0].heads_first else t[0, 2]
    assert _block_bytes(layouts[0], 2)[: k.numel() * 2] == bytes(k.contiguous().view(torch.uint8).numpy())


@five_dim
def test_mla_tensor_matches_prediction(monkeypatch) -> None:
    backend = _backend("MLA")
    _force_layout(monkeypatch, None)
    tensors = [_allocate(backend, NB, 1, MLA_DIM, torch.bfloat16) for _ in range(LAYERS)]
    layout = BlockLayout.from_kv_caches(tensors, kind="mla")
    assert layout.fingerprint == _predicted("NHD", use_mla=True, heads=1, head=MLA_DIM)


# ------------------------------------------------------------- generic [B, H, N, C] views
bhnc = pytest.mark.skipif(FACTS.kv_layout_source != "cache-config",
                          reason=f"vLLM {_DIST.version} hands each backend's own shape")


def _generic_caches(layout_name: str, *, mla: bool = False, dtype=torch.bfloat16):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    if mla:
        spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=MLA_DIM, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NB, LAYERS, layout)
    size = spec.page_size_bytes * NB * LAYERS
    config = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                                        block_stride=block_stride)],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    return allocate_kv_cache(config, torch.device("cpu"), layout)


@bhnc
@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "NHD", "HND"])
def test_generic_views_match_prediction(layout_name) -> None:
    from vllm.v1.attention.backends.utils import _layout_from_name  # noqa: F401

    resolved = {"NHD": "LBNHC", "HND": "LBHNC"}.get(layout_name, layout_name)
    caches = _generic_caches(resolved)
    layout = BlockLayout.from_kv_caches(caches, kind="hnc")
    config = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout=layout_name))
    assert layout.fingerprint == _predicted(gpu_layout_name(config, FACTS))
    assert layout.num_blocks == NB and layout.block_size == BS


@bhnc
def test_cross_layer_views_hold_the_same_bytes_as_per_layer_views() -> None:
    per_layer = BlockLayout.from_kv_caches(_generic_caches("LBNHC"), kind="hnc")
    cross = BlockLayout.from_kv_caches(_generic_caches("BLNHC"), kind="hnc")
    assert per_layer.fingerprint == cross.fingerprint
    assert len(cross.regions()) == 1  # one buffer, layers interleaved per block
    for a, b in zip(per_layer.tensors, cross.tensors):
        g = torch.Generator().manual_seed(1)
        src = torch.randn(a.shape, generator=g).to(a.dtype)
        a.copy_(src)
        b.copy_(src)
    for block in range(NB):
        assert _block_bytes(per_layer, block) == _block_bytes(cross, block)


@bhnc
@pytest.mark.parametrize("layout_name", SPLIT_PAGE_LAYOUTS)
def test_split_page_layouts_are_refused_clearly(layout_name) -> None:
    from mooncake_vllm.errors import UnsupportedVersionError

    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT"):
        BlockLayout.from_kv_caches(_generic_caches(layout_name), kind="hnc")
    with pytest.raises(UnsupportedVersionError, match="VLLM_KV_CACHE_LAYOUT"):
        predict_block(FACTS, layout_name, use_mla=False, heads=HEADS, head_size=HEAD,
                      block_size=BS)


@bhnc
def test_generic_mla_views_match_prediction() -> None:
    layout = BlockLayout.from_kv_caches(_generic_caches("LBNHC", mla=True), kind="hnc")
    assert layout.fingerprint == _predicted("LBNHC", use_mla=True, heads=1, head=MLA_DIM)
