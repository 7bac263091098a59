#!/usr/bin/env bash
# On the GPU machine, after install.sh: the real-engine proof of issue 11 (vLLM 0.24.0).
# An 8B-class random Llama built on the GPU; per mode one process per instance:
#   none   (recompute, then an in-HBM prefix hit of the same prompt)
#   intree (vLLM's own MooncakeStoreConnector: MOONCAKE_VLLM_DISABLE=1, PYTHONHASHSEED=0)
#   ours   (no PYTHONHASHSEED)
# A saves, a fresh B loads; TTFT at LENGTHS; table from bench_gpu_ttft.py --summarize.
set -uo pipefail
source scripts/gpu/env.sh
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
export PATH=/tmp/site/bin:/tmp/site/mooncake:$PATH
OUT=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p "$OUT" $R
MODES=${MODES:-"none ours intree"}
LENGTHS=${LENGTHS:-2048,8000,16000}
[ -f /tmp/model/config.json ] || python3 scripts/gpu/make_model.py /tmp/model
for mode in $MODES; do
  if [ "$mode" = none ]; then phases="A"; else phases="A B"; bash scripts/gpu/mc_up.sh >/dev/null; fi
  export MOONCAKE_CONFIG_PATH=/tmp/mc/config.json
  if [ "$mode" = intree ]; then export MOONCAKE_VLLM_DISABLE=1 PYTHONHASHSEED=0; else unset MOONCAKE_VLLM_DISABLE PYTHONHASHSEED; fi
  for phase in $phases; do
    echo "=== $mode $phase $(date +%T)"
    setsid timeout -s KILL ${RUN_TIMEOUT:-170} python3 bench/bench_gpu_ttft.py --mode $mode --phase $phase \
      --lengths $LENGTHS --out $R/${mode}_${phase}.json > $R/${mode}_${phase}.log 2>&1 &
    pid=$!; wait $pid; echo "rc=$?"; kill -9 -- -$pid 2>/dev/null
    grep -E "^RUN|^ERROR|mooncake-vllm|Traceback|Error|KV cache on" $R/${mode}_${phase}.log | grep -v "^[EWI][0-9]\{4\} " | cut -c1-300 | head -14
  done
  [ "$mode" != none ] && bash scripts/gpu/mc_down.sh >/dev/null 2>&1
done
python3 bench/bench_gpu_ttft.py --summarize $R | tee $OUT/ttft_table.md
tar -czf $OUT/ttft_runs.tgz -C /tmp res 2>/dev/null
echo "=== done $(date +%T)"
