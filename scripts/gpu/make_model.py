#!/usr/bin/env python3
"""Build a random-weight Llama on the GPU with transformers and save it for vLLM (no download).

  python3 scripts/gpu/make_model.py DIR [--preset 8b|tiny]

8b (default): 32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads x 128, vocab 32000,
bf16, max_position_embeddings 32768: ~7.2B parameters, 14.5 GB on disk, 128 KiB of KV per token.
tiny: the 2026-12-01 recipe's model (16 layers, hidden 1024, 4 KV heads x 128): 32 KiB KV per token.
Skips the build when DIR/config.json exists. No tokenizer: run vLLM with skip_tokenizer_init=True
and prompts given as token ids.
"""
import argparse
import json
import os
import sys
import time

PRESETS = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, max_position_embeddings=32768),
    "tiny": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=128, max_position_embeddings=16384),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="where to build it (cuda; cpu for a dry run)")
    args = ap.parse_args()
    cfg_path = os.path.join(args.dir, "config.json")
    if os.path.exists(cfg_path):
        c = json.load(open(cfg_path))
        print(f"model exists in {args.dir}: layers {c.get('num_hidden_layers')}, hidden {c.get('hidden_size')}, "
              f"kv heads {c.get('num_key_value_heads')}")
        return 0
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    cfg = LlamaConfig(vocab_size=32000, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, **PRESETS[args.preset])
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly: no fp32 copy of 7B weights
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t_build = time.time() - t0
    tmp = args.dir.rstrip("/") + ".partial"  # config.json appears only once every file is written
    model.save_pretrained(tmp, safe_serialization=True)
    os.makedirs(args.dir, exist_ok=True)
    for f in sorted(os.listdir(tmp), key=lambda f: f == "config.json"):
        os.replace(os.path.join(tmp, f), os.path.join(args.dir, f))
    os.rmdir(tmp)
    c = json.load(open(cfg_path))
    n = sum(p.numel() for p in model.parameters())
    size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir))
    kv = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2
    print(f"saved {args.preset} model to {args.dir}: {n / 1e9:.2f}B params, {size / 1e9:.1f} GB, "
          f"KV {kv // 1024} KiB/token; build {t_build:.1f}s, total {time.time() - t0:.1f}s")
    print({k: c.get(k) for k in ("architectures", "dtype", "torch_dtype", "hidden_size", "num_hidden_layers",
                                 "num_key_value_heads", "head_dim", "max_position_embeddings")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
