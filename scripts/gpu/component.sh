#!/usr/bin/env bash
# On the GPU machine, from the repo root, after install.sh: the component proof of issue 11.
#   1. pytest -m gpu (+ the host store tests): real master/holder on loopback, CUDA tensors in
#      every layout, bf16/fp16/fp8; JUnit with provenance to $OUT/gpu-component.xml
#   2. bench/bench_gpu_store.py: save/load GB/s of 4k tokens of an 8B-class KV vs the raw
#      store and the copy ceilings, one run; $OUT/gpu_store.json
# MOONCAKE_VLLM_TREE_COMMIT / _STATE: the commit this copy of the tree was made from (the GPU
# machine receives files, not the repository), recorded in the JUnit file's provenance.
set -uo pipefail
source scripts/gpu/env.sh
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
export PATH=/tmp/site/bin:/tmp/site/mooncake:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the wheel's console script, which a --target install does not write
mkdir -p /tmp/site/bin
printf '#!/bin/sh\nexec python3 -c "import sys; from mooncake.http_metadata_server import main; sys.exit(main())" "$@"\n' \
  > /tmp/site/bin/mooncake_http_metadata_server && chmod +x /tmp/site/bin/mooncake_http_metadata_server
python3 -c 'import torch, mooncake_vllm; print("torch", torch.__version__, torch.cuda.get_device_name())'
echo "=== pytest (gpu + store) $(date +%T)"
timeout 300 python3 -m pytest -p no:cacheprovider -q -x -o addopts="" -m "gpu or not vllm" \
  tests/store tests/test_layout.py tests/test_codec.py \
  --junitxml="$OUT/gpu-component.xml" -o junit_suite_name=gpu-h200 2>&1 | tail -25
echo "=== bench_gpu_store $(date +%T)"
bash scripts/gpu/mc_up.sh >/dev/null 2>&1 || bash scripts/gpu/mc_up.sh
export MOONCAKE_CONFIG_PATH=/tmp/mc/config.json
timeout 200 python3 bench/bench_gpu_store.py 2>&1 | grep -v "^[EWI][0-9]\{4\} " | tail -15
bash scripts/gpu/mc_down.sh >/dev/null 2>&1
echo "=== done $(date +%T)"
