#!/usr/bin/env bash
# On the GPU machine after install.sh (b1), with .carry/v0 carried (make_v0_bundle.sh): the V0
# connector tests (tests/v0) with the real vllm==0.10.0 V0 classes on CUDA KV tensors and a real
# master + holder; JUnit with provenance in $OUT/v0-gpu.xml. vLLM 0.10.0's pure Python goes on its
# own PYTHONPATH in front (no vLLM 0.24 in this process).
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/site/bin
V0=${V0_BUNDLE:-.carry/v0/v0site.tar.xz}
[ -d /tmp/v0site/vllm ] || python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$V0" /tmp/v0site
printf '#!/bin/sh\nexec python3 -c "import sys; from mooncake.http_metadata_server import main; sys.exit(main())" "$@"\n' \
  > /tmp/site/bin/mooncake_http_metadata_server && chmod +x /tmp/site/bin/mooncake_http_metadata_server
unset MOONCAKE_CONFIG_PATH
PYTHONPATH=/tmp/v0site:$PWD/src:/tmp/site PATH=/tmp/site/bin:/tmp/site/mooncake:$PATH \
  timeout ${V0_TIMEOUT:-200} python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/v0 \
  --junitxml="$OUT/v0-gpu.xml" -o junit_suite_name=vllm-0.10.0 2>&1 | grep -v "^[EWI][0-9]\{4\} " | tail -15
