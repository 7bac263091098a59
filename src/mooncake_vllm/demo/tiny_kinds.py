"""Tiny random models of other KV-cache kinds, built offline next to the tiny Llama.

* ``mla``: DeepSeek-V2 style (MLA: one 576-wide latent per token, ``kv_lora_rank``
  512 + rope 64, the only width vLLM's CPU MLA kernel runs), dense MLP layers.
* ``sliding``: the tiny Llama with Gemma-2 style ``layer_types``: a
  sliding-window layer, then a full-attention one (vLLM gives them one
  full-attention KV cache group when a connector is set).
* ``all-sliding``: the same with every layer sliding-window (one sliding-window
  group: the connector refuses it at start).

Everything starts from the tiny Llama built by
:func:`~mooncake_vllm.demo.tiny_model.cached_tiny_model` (its tokenizer; for the
sliding kinds its weights too). MLA weights come from ``torch.manual_seed(seed)``
with a wide init, so greedy outputs do not collapse into one repeated token
(token identity then means something; random Gemma-2 weights do collapse). A build takes a
few seconds and is reused while its parameters match.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mooncake_vllm.demo.tiny_model import STAMP_NAME, cached_tiny_model, default_cache_dir

__all__ = ["TINY_KINDS", "cached_tiny_kind", "tiny_kind_config"]

TINY_KINDS = ("mla", "sliding", "all-sliding")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json")
#: sliding window of the Gemma-2 style models, tokens (well inside a test prompt)
SLIDING_WINDOW = 16


def tiny_kind_config(kind: str, llama_config: dict[str, Any]) -> dict[str, Any]:
    """Tiny model ``kind``: its transformers class prefix (``"class"``) and config kwargs
    (for ``Llama``: keys set in a copy of the tiny Llama's config);
    vocabulary and special tokens from the tiny Llama's ``llama_config``."""
    common = {"vocab_size": llama_config["vocab_size"], "hidden_size": 128,
              "intermediate_size": 256, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "initializer_range": 0.1, "bos_token_id": llama_config["bos_token_id"],
              "eos_token_id": llama_config["eos_token_id"],
              "pad_token_id": llama_config.get("pad_token_id")}
    if kind == "mla":
        return {"class": "DeepseekV2", **common, "num_hidden_layers": 2,
                "num_key_value_heads": 4, "moe_intermediate_size": 64, "n_shared_experts": 1,
                "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 2,
                "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 32, "v_head_dim": 32}
    if kind in ("sliding", "all-sliding"):
        # the tiny Llama's own weights; vLLM's Llama honours per-layer ``layer_types``
        layers = ["sliding_attention"] * 2 if kind == "all-sliding" else [
            "sliding_attention", "full_attention"]
        return {"class": "Llama", "sliding_window": SLIDING_WINDOW, "layer_types": layers}
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(TINY_KINDS)}")


def _build(out: Path, spec: dict[str, Any], tokenizer_dir: Path, seed: int) -> None:
    if spec["class"] == "Llama":  # the tiny Llama with per-layer sliding windows
        for item in tokenizer_dir.iterdir():
            if item.is_file() and item.name != STAMP_NAME:
                shutil.copy(item, out / item.name)
        config = json.loads((out / "config.json").read_text())
        config.update({k: v for k, v in spec.items() if k != "class"})
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return
    import torch
    import transformers

    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    kwargs = {k: v for k, v in spec.items() if k != "class"}
    config = getattr(transformers, f"{spec['class']}Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{spec['class']}ForCausalLM")(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def cached_tiny_kind(kind: str, *, seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """Build (or reuse) tiny model ``kind``; returns its directory."""
    tokenizer_dir = cached_tiny_model()
    spec = tiny_kind_config(kind, json.loads((tokenizer_dir / "config.json").read_text()))
    stamp = {"kind": kind, "seed": seed, "spec": spec, "tokenizer": tokenizer_dir.name}
    digest = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = base / f"tiny-{kind}-{digest}"
    try:
        if json.loads((path / STAMP_NAME).read_text()) == stamp:
            return path
    except (OSError, ValueError):
        pass
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{kind}-", dir=base))
    try:
        _build(tmp, spec, tokenizer_dir, seed)
        (tmp / STAMP_NAME).write_text(json.dumps(stamp))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
