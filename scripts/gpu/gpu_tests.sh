#!/usr/bin/env bash
# On the GPU machine after install.sh (b1 and b2): every `gpu` test — the store on CUDA tensors
# in every layout and the real vLLM engine A/B — with JUnit + provenance in $OUT/gpu.xml.
# Set MOONCAKE_VLLM_TREE_COMMIT/_STATE to the commit this copy of the tree was made from;
# GPU_TESTS narrows the selection (default: tests/gpu tests/store), GPU_JUNIT names the file.
set -uo pipefail
source scripts/gpu/env.sh
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PATH=/tmp/site/bin:/tmp/site/mooncake:$PATH
unset MOONCAKE_CONFIG_PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/site/bin
# the wheel's console script, which a --target install does not write
printf '#!/bin/sh\nexec python3 -c "import sys; from mooncake.http_metadata_server import main; sys.exit(main())" "$@"\n' \
  > /tmp/site/bin/mooncake_http_metadata_server && chmod +x /tmp/site/bin/mooncake_http_metadata_server
timeout ${GPU_TEST_TIMEOUT:-520} python3 -m pytest -p no:cacheprovider -q -o addopts="" -m gpu \
  ${GPU_TESTS:-tests/gpu tests/store} --junitxml="$OUT/${GPU_JUNIT:-gpu.xml}" -o junit_suite_name=vllm-0.24.0 2>&1 \
  | grep -v "^[EWI][0-9]\{4\} " | tail -15
