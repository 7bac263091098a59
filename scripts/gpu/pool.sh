#!/usr/bin/env bash
# On the GPU machine, from the repo root, after install.sh (b1): issue 24's store-level run —
# the 8B model written in the background for the engine calls, a pool of MC_HOLDERS holders
# (mc_up.sh), the parallel TCP ceiling against ours (bench/bench_pool.py), then the gpu tests of
# the store and the worker's timer (JUnit with provenance).
#   bash scripts/gpu/pool.sh
set -uo pipefail
source scripts/gpu/env.sh
export PATH=/tmp/site/bin:$MCBIN:$PATH PYTHONPATH=$PWD/src:$PYTHONPATH  # the tree's code first
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f /tmp/model/config.json ] || (setsid python3 scripts/gpu/make_model.py /tmp/model > /tmp/make_model.log 2>&1 < /dev/null &)
MC_HOLDERS=${MC_HOLDERS:-4} MC_SEGMENT=${MC_SEGMENT:-68719476736} bash scripts/gpu/mc_up.sh | grep -v config
nproc; free -g | head -2
timeout ${POOL_TIMEOUT:-240} python3 bench/bench_pool.py --out "$OUT/pool.json" ${POOL_ARGS:-} 2>&1 \
  | grep -v "^[EWI][0-9]\{4\} "
echo "[pool] bench rc=$?"
GPU_TESTS=${GPU_TESTS:-"tests/store tests/v1/test_perf.py"} GPU_JUNIT=${GPU_JUNIT:-store.xml} \
  GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-330} bash scripts/gpu/gpu_tests.sh
echo "[pool] model: $(tail -1 /tmp/make_model.log 2>/dev/null)"
