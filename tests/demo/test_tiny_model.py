"""The offline tiny model: builds, reloads with transformers offline, tokenizes deterministically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_vllm.demo.tiny_model import STAMP_NAME, build_tiny_model, tiny_model_params

# Reload in a fresh, offline interpreter (a given PYTHONHASHSEED) and report what it sees.
RELOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
ids = tok("def main():\\n    return 42")["input_ids"]
chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits
print(json.dumps({"ids": ids, "bos": tok.bos_token_id, "vocab": len(tok), "chat": chat,
                  "layers": model.config.num_hidden_layers, "dtype": str(model.dtype),
                  "params": sum(p.numel() for p in model.parameters()),
                  "logit0": float(logits[0, -1, 0])}))
"""


def _reload(path: Path, hashseed: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": hashseed}
    out = subprocess.run([sys.executable, "-c", RELOAD, str(path)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tiny_model_reloads_offline_and_tokenizes_deterministically(tiny_model: Path) -> None:
    a, b = _reload(tiny_model, "1"), _reload(tiny_model, "12345")
    assert a == b  # same token ids, same weights, whatever the hash seed
    assert a["ids"][0] == a["bos"] and len(a["ids"]) > 3
    assert a["vocab"] == 2048 and a["layers"] == 2 and a["dtype"] == "torch.float32"
    assert a["chat"] == "user: hi\nassistant: "
    assert 500_000 < a["params"] < 2_000_000
    stamp = json.loads((tiny_model / STAMP_NAME).read_text())
    assert stamp == tiny_model_params()


def test_build_is_idempotent_and_keyed_by_parameters(tiny_model: Path, tmp_path: Path) -> None:
    before = {f.name: f.stat().st_mtime_ns for f in tiny_model.iterdir()}
    assert build_tiny_model(tiny_model) == tiny_model  # same parameters: nothing rebuilt
    assert {f.name: f.stat().st_mtime_ns for f in tiny_model.iterdir()} == before
    # A stamp for other parameters is not trusted.
    copy = tmp_path / "m"
    copy.mkdir()
    (copy / STAMP_NAME).write_text(json.dumps(tiny_model_params(seed=1)))
    from mooncake_vllm.demo import tiny_model as tm

    assert not tm._stamp_matches(copy, tiny_model_params())


@pytest.mark.parametrize(("field", "value"), [("num_layers", 0), ("num_kv_heads", 3), ("dtype", "int8"),
                                              ("head_dim", "32"), ("max_positions", 0)])
def test_bad_parameters_name_the_field(tmp_path: Path, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}: got"):
        build_tiny_model(tmp_path / "m", **{field: value})
    assert not (tmp_path / "m").exists()


def test_max_positions_is_keyed_only_when_not_the_default(tmp_path: Path) -> None:
    """vLLM's CPU RoPE reads its table unchecked: a bench whose prompts pass 4096 positions
    builds a model that declares them (and earlier builds keep their keys)."""
    from mooncake_vllm.demo.tiny_model import MAX_POSITIONS

    assert tiny_model_params(max_positions=MAX_POSITIONS) == tiny_model_params()
    assert tiny_model_params(max_positions=16384)["max_positions"] == 16384
    with pytest.raises(TypeError, match="max_positions"):
        tiny_model_params(max_position=16384)
    built = build_tiny_model(tmp_path / "long", num_layers=1, hidden_size=32, intermediate_size=64,
                             num_heads=2, num_kv_heads=1, head_dim=16, max_positions=16384)
    assert json.loads((built / "config.json").read_text())["max_position_embeddings"] == 16384


def test_tokenizer_config_loads_under_transformers_4_and_5(tiny_model: Path, tmp_path: Path) -> None:
    # transformers 5 saves "TokenizersBackend", unknown to transformers 4 (vLLM <= 0.11 envs)
    assert json.loads((tiny_model / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    from mooncake_vllm.demo.tiny_model import portable_tokenizer_config

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    (legacy / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>"}))
    portable_tokenizer_config(legacy)
    cfg = json.loads((legacy / "tokenizer_config.json").read_text())
    assert cfg == {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    assert _reload_tokenizer(legacy) == _reload_tokenizer(tiny_model)


def _reload_tokenizer(path: Path) -> list[int]:
    code = ("import sys; from transformers import AutoTokenizer; "
            "print(AutoTokenizer.from_pretrained(sys.argv[1])('def main(): return 42')['input_ids'])")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
