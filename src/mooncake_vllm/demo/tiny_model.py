"""A tiny random Llama and a byte-level BPE tokenizer, built offline (running-on-cpu.md 2.4).

No model hub: the tokenizer is trained on the first 200 sorted ``*.py`` files of
this interpreter's standard library (so token ids depend on the Python version),
the weights come from ``torch.manual_seed(seed)``. A build takes a few seconds
and is skipped when ``path`` already holds a model built with the same parameters.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "MAX_POSITIONS",
    "STAMP_NAME",
    "build_tiny_model",
    "cached_tiny_model",
    "default_cache_dir",
    "portable_tokenizer_config",
    "tiny_model_params",
]

STAMP_NAME = ".mooncake-vllm-tiny-model.json"
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
VOCAB_SIZE = 2048
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
_DTYPES = ("float32", "bfloat16", "float16")
#: positions the model declares (``max_positions``); vLLM's CPU RoPE reads its table unchecked,
#: so a prompt past them (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``) computes from memory beyond it
MAX_POSITIONS = 4096


def default_cache_dir() -> Path:
    """Where built models are kept between runs (``$MOONCAKE_VLLM_CACHE`` or ~/.cache/mooncake-vllm)."""
    base = os.environ.get("MOONCAKE_VLLM_CACHE") or os.path.join(Path.home(), ".cache", "mooncake-vllm")
    return Path(base) / "models"


def tiny_model_params(**overrides: Any) -> dict[str, Any]:
    """The full parameter set (defaults + overrides) a build is keyed by, incl. the Python version."""
    params: dict[str, Any] = {
        "num_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_heads": 4,
        "num_kv_heads": 2, "head_dim": 32, "dtype": "float32", "seed": 0,
    }
    known = set(params) | {"max_positions"}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"unknown tiny-model parameter(s) {sorted(unknown)}; known: {sorted(known)}")
    params.update(overrides)
    if params.get("max_positions") == MAX_POSITIONS:  # the default: earlier builds' keys stay
        del params["max_positions"]
    params["python"] = f"{sys.version_info[0]}.{sys.version_info[1]}"  # the tokenizer's training corpus
    params["vocab_size"] = VOCAB_SIZE
    return params


def _validate(p: dict[str, Any]) -> None:
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
        if not isinstance(p[field], int) or isinstance(p[field], bool) or p[field] <= 0:
            raise ValueError(f"{field}: got {p[field]!r}, expected a positive int")
    if p["num_heads"] % p["num_kv_heads"]:
        raise ValueError(f"num_kv_heads: got {p['num_kv_heads']}, expected a divisor of num_heads "
                         f"({p['num_heads']})")
    if p["dtype"] not in _DTYPES:
        raise ValueError(f"dtype: got {p['dtype']!r}, expected one of {_DTYPES}")
    if not isinstance(p["seed"], int):
        raise ValueError(f"seed: got {p['seed']!r}, expected an int")
    positions = p.get("max_positions", MAX_POSITIONS)
    if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:
        raise ValueError(f"max_positions: got {positions!r}, expected a positive int")


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(f) for f in stdlib.glob("*.py"))[:200]
    if not files:
        raise RuntimeError(f"no *.py files in the standard library at {stdlib}: cannot train the tokenizer")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train(files, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build(out: Path, p: dict[str, Any]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(out)
    portable_tokenizer_config(out)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_layers"], num_attention_heads=p["num_heads"],
        num_key_value_heads=p["num_kv_heads"], head_dim=p["head_dim"],
        max_position_embeddings=p.get("max_positions", MAX_POSITIONS),
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(p["seed"])
    model = LlamaForCausalLM(cfg).to(getattr(torch, p["dtype"]))
    model.save_pretrained(out, safe_serialization=True)


#: transformers 5 saves a fast tokenizer as ``TokenizersBackend``, a class transformers 4
#: (the env of vLLM <= 0.11) does not know; both load ``PreTrainedTokenizerFast`` alike.
_PORTABLE_TOKENIZER = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def portable_tokenizer_config(path: Path) -> None:
    """Name the tokenizer class in ``path`` by what transformers 4 and 5 both load (idempotent)."""
    cfg_path = path / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return
    name = _PORTABLE_TOKENIZER.get(cfg.get("tokenizer_class"))
    if name is None:
        return
    cfg["tokenizer_class"] = name
    tmp = cfg_path.with_name(f".{cfg_path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tmp.replace(cfg_path)


def _stamp_matches(path: Path, params: dict[str, Any]) -> bool:
    try:
        return json.loads((path / STAMP_NAME).read_text()) == params
    except (OSError, ValueError):
        return False


def build_tiny_model(
    path: str | os.PathLike,
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: str = "float32",
    seed: int = 0,
    max_positions: int = MAX_POSITIONS,
) -> Path:
    """Build (or reuse) the tiny Llama + tokenizer in ``path``; return ``path``.

    Idempotent and safe to call from several processes at once: the build runs
    under a file lock into a temporary directory that is renamed into place,
    and a stamp file records the parameters.
    """
    params = tiny_model_params(
        num_layers=num_layers, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed,
        max_positions=max_positions,
    )
    _validate(params)
    path = Path(path)
    if _stamp_matches(path, params):
        portable_tokenizer_config(path)  # a model built before the config was made portable
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _stamp_matches(path, params):  # another process built it meanwhile
            return path
        tmp = path.parent / f".{path.name}.building-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _build(tmp, params)
            (tmp / STAMP_NAME).write_text(json.dumps(params, indent=1, sort_keys=True) + "\n")
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def cached_tiny_model(cache_dir: str | os.PathLike | None = None, **params: Any) -> Path:
    """Build (once) or reuse the tiny model in a cache directory keyed by its parameters.

    ``cache_dir`` defaults to :func:`default_cache_dir`; ``params`` are those of
    :func:`build_tiny_model`.
    """
    full = tiny_model_params(**params)
    key = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_tiny_model(base / f"tiny-llama-{key}", **params)
