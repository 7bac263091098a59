"""Layout prediction from the config, per release facts (no vLLM, no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mooncake_vllm.compat.versions import vllm_facts
from mooncake_vllm.errors import UnsupportedVersionError
from mooncake_vllm.layout import BlockLayout, bytes_kind, layout_fingerprint
from mooncake_vllm.v1.layout_prediction import gpu_layout_name, predict_block
from mooncake_vllm.v1.namespace import ExpectedLayout

NO_BW = SimpleNamespace(cache_config=SimpleNamespace(), attention_config=None)


def _fp(facts, name, **kw):
    kind, hf, shape = predict_block(facts, name, **kw)
    return layout_fingerprint(bytes_kind(kind, hf), "bfloat16", 2, shape)


@pytest.mark.parametrize("version,env,expected", [
    ("0.9.0", {"VLLM_KV_CACHE_LAYOUT": "HND"}, "NHD"),   # no stride orders yet
    ("0.9.1", {"VLLM_KV_CACHE_LAYOUT": "HND"}, "NHD"),   # only NixlConnector gets HND
    ("0.9.2", {"VLLM_KV_CACHE_LAYOUT": "HND"}, "HND"),
    ("0.24.0", {}, "NHD"),
    ("0.24.0", {"VLLM_KV_CACHE_LAYOUT": "HND"}, "HND"),
])
def test_layout_name_per_release(version, env, expected) -> None:
    assert gpu_layout_name(NO_BW, vllm_facts(version), env=env) == expected


def test_resolved_layout_is_read_from_cache_config() -> None:
    facts = vllm_facts("0.32.0")
    assert facts.kv_view_shape == "bhnc" and facts.cross_layer_kv == "layout"
    cfg = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout="BLHNC"))
    assert gpu_layout_name(cfg, facts, env={}) == "BLHNC"
    cfg = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout="HND"))
    assert gpu_layout_name(cfg, facts, env={}) == "LBHNC"
    cfg = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout=None))
    assert gpu_layout_name(cfg, facts, env={}) == "LBNHC"


def test_facts_rows() -> None:
    assert vllm_facts("0.26.0").kv_view_shape == "backend"
    packed = vllm_facts("0.28.0")  # K and V packed in the content dim, backends decide NHD/HND
    assert (packed.kv_view_shape, packed.kv_layout_source) == ("bhnc", "backends-utils")
    assert vllm_facts("0.10.1").kv_layout_connector_hook
    assert vllm_facts("0.12.0").cross_layer_kv == "opt-in"


def test_predicted_fingerprints_equal_real_tensors() -> None:
    f = vllm_facts("0.24.0")
    kw = dict(use_mla=False, heads=4, head_size=8, block_size=16)
    fa = torch.zeros(2, 5, 4, 16, 8, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)  # HND
    fi = torch.zeros(5, 2, 16, 4, 8, dtype=torch.bfloat16)  # NHD, FlashInfer
    assert BlockLayout.from_kv_caches([fa, fa.clone()], kind="nhd").fingerprint == _fp(f, "HND", **kw)
    assert BlockLayout.from_kv_caches([fi, fi.clone()], kind="nhd").fingerprint == _fp(f, "NHD", **kw)
    # one KV head (e.g. TP over all heads): HND holds NHD's bytes
    one = torch.zeros(2, 5, 1, 16, 8, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    assert BlockLayout.from_kv_caches([one, one], kind="nhd").fingerprint == \
        _fp(f, "HND", use_mla=False, heads=1, head_size=8, block_size=16)
    mla = torch.zeros(5, 16, 24, dtype=torch.bfloat16)
    assert BlockLayout.from_kv_caches([mla, mla], kind="mla").fingerprint == \
        _fp(f, "NHD", use_mla=True, heads=1, head_size=24, block_size=16)


def test_packed_backend_tensors_of_0_28_match_the_prediction() -> None:
    """0.27-0.28: each layer is the backend's (B, H, N, 2*D), NHD by stride order (0, 2, 1, 3)."""
    f = vllm_facts("0.28.0")
    kw = dict(use_mla=False, heads=4, head_size=8, block_size=16)
    nhd = torch.zeros(5, 16, 4, 16, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    hnd = torch.zeros(5, 4, 16, 16, dtype=torch.bfloat16)
    for name, t in (("NHD", nhd), ("HND", hnd)):
        kind = predict_block(f, name, **kw)[0]
        assert kind == "hnc"
        assert BlockLayout.from_kv_caches([t, t.clone()], kind=kind).fingerprint == _fp(f, name, **kw)
    assert _fp(f, "NHD", **kw) != _fp(f, "HND", **kw)
    assert _fp(f, "NHD", **kw) != _fp(vllm_facts("0.24.0"), "NHD", **kw)  # other bytes than 5-dim
    mla = torch.zeros(5, 16, 24, dtype=torch.bfloat16)  # MLA keeps [B, N, head] there
    assert BlockLayout.from_kv_caches([mla, mla], kind="mla").fingerprint == \
        _fp(f, "NHD", use_mla=True, heads=1, head_size=24, block_size=16)


def test_generic_views_and_refusals() -> None:
    f = vllm_facts("0.32.0")
    kw = dict(use_mla=False, heads=4, head_size=8, block_size=16)
    nhc = torch.zeros(5, 16, 4, 16, dtype=torch.bfloat16).permute(0, 2, 1, 3)  # LBNHC
    assert BlockLayout.from_kv_caches([nhc, nhc], kind="hnc").fingerprint == _fp(f, "LBNHC", **kw)
    assert _fp(f, "LBNHC", **kw).startswith("nhc:") and _fp(f, "BLHNC", **kw).startswith("hnc:")
    for name in ("BHLNC", "LHBNC", "XYZ"):
        with pytest.raises(UnsupportedVersionError, match="layout"):
            predict_block(f, name, **kw)
    with pytest.raises(UnsupportedVersionError, match="NHD and HND"):
        predict_block(vllm_facts("0.24.0"), "LBNHC", **kw)


def test_expected_layout_names_hnd() -> None:
    e = ExpectedLayout("nhd", "", "uint8", 32, (2, 16, 8, 128), heads_first=True)
    assert e.fingerprint == "hnd:uint8:L32:2x16x8x128"
    assert ExpectedLayout("nhd", "", "bfloat16", 1, (2, 16, 8, 128)).fingerprint.startswith("nhd:")
