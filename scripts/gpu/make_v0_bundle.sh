#!/usr/bin/env bash
# The pure-Python part of the real vllm==0.10.0 wheel (its .so files dropped) + gguf, which its
# V0 model-input classes import, packed for the GPU machine: tests/v0 then run there on CUDA
# tensors (scripts/gpu/v0_tests.sh). The V0 *engine* cannot run there (vLLM <= 0.10.0 pins
# torch <= 2.7; the machine has 2.11 and no network); the connector-level tests need only the
# real V0 classes (ModelInputForGPUWithSamplingMetadata, FlashAttentionMetadata, KVTransferConfig).
#   bash scripts/gpu/make_v0_bundle.sh [OUT_DIR]     (default: <repo>/.carry/v0)
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=${1:-$root/.carry/v0}
wheel=${V0_WHEEL:-$HOME/.cache/mooncake-vllm/wheels/vllm-0.10.0-cp38-abi3-manylinux1_x86_64.whl}
env_site=$(ls -d "$HOME"/.cache/mooncake-vllm/envs/vllm-0.10.0/lib/python3*/site-packages | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/site" "$out"
(cd "$tmp/site" && unzip -q "$wheel" -x '*.so')
cp -r "$env_site"/gguf "$env_site"/gguf-*.dist-info "$tmp/site/"
# on a CUDA machine vllm/platforms/cuda.py imports vllm._C (the dropped kernels) only to register
# ops; no test calls one, so an empty module stands in for it
printf '"""Stand-in for the dropped vllm._C kernels (connector-level tests call none)."""\n' \
  > "$tmp/site/vllm/_C.py"
tar -C "$tmp/site" -cJf "$out/v0site.tar.xz" .
ls -l "$out/v0site.tar.xz"
