#!/usr/bin/env bash
# On the GPU machine after install.sh (b1): the GPU zero-copy proof.
#   1. pytest -m gpu tests/store (every layout, staged and zero-copy, each reading the other's
#      values; GPU checksums = host checksums; planted corrupt/foreign/xxh3 values are misses;
#      a block reused before its zero-copy put is removed) + the CPU checksum tests;
#      JUnit with provenance in $OUT/gpu-store.xml
#   2. bench/bench_gpu_store.py: both gpu_path values side by side with the ceilings; $OUT/gpu_store.json
#   3. the 8B-class model for the engine call (scripts/gpu/engine.sh)
# MOONCAKE_VLLM_TREE_COMMIT / _STATE: the commit this copy of the tree was made from. (The V0
# tests on CUDA now run inside the real V0 engine's environment: v0_engine.sh tests, issue 25.)
set -uo pipefail
source scripts/gpu/env.sh
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PATH=/tmp/site/bin:/tmp/site/mooncake:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/site/bin
printf '#!/bin/sh\nexec python3 -c "import sys; from mooncake.http_metadata_server import main; sys.exit(main())" "$@"\n' \
  > /tmp/site/bin/mooncake_http_metadata_server && chmod +x /tmp/site/bin/mooncake_http_metadata_server
echo "=== pytest gpu store $(date +%T)"
(unset MOONCAKE_CONFIG_PATH; timeout ${TEST_TIMEOUT:-300} python3 -m pytest -p no:cacheprovider -q -o addopts="" \
  -m gpu tests/store --junitxml="$OUT/gpu-store.xml" -o junit_suite_name=gpu-h200 2>&1 \
  | grep -v "^[EWI][0-9]\{4\} " | tail -30
 timeout 60 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/test_codec.py tests/store/test_paths.py 2>&1 | tail -3)
echo "=== bench_gpu_store $(date +%T)"
bash scripts/gpu/mc_up.sh >/dev/null 2>&1 || bash scripts/gpu/mc_up.sh
MOONCAKE_CONFIG_PATH=/tmp/mc/config.json timeout ${BENCH_TIMEOUT:-240} python3 bench/bench_gpu_store.py 2>&1 \
  | grep -v "^[EWI][0-9]\{4\} " | tail -20
bash scripts/gpu/mc_down.sh >/dev/null 2>&1
echo "=== model $(date +%T)"
[ "${MAKE_MODEL:-1}" = 1 ] && python3 scripts/gpu/make_model.py /tmp/model 2>&1 | tail -2
echo "=== done $(date +%T)"
