#!/usr/bin/env bash
# On the GPU machine, from the repo root, once b1 and b2 are installed (install.sh): issue 26's
# sitting — the seed's MultiConnector(MooncakeConnector + MooncakeStoreConnector) XpYd through
# `mooncake-vllm proxy --flow p2p`, against P2P alone and our store-only hand-off, plus a third
# instance with the plain seed JSON reading the pair's prompts from the pool
# (bench/bench_gpu_multi.py: $OUT/multi.json, $OUT/multi_table.md).
#   bash scripts/gpu/multi.sh
# The model: /tmp/model (make_model.py, maybe still being written: waits up to MODEL_WAIT s). The
# pool: mc_up.sh (reuses a running one). MULTI_ARGS: extra bench options (e.g. --modes p2p_store).
set -uo pipefail
source scripts/gpu/env.sh
export PATH=/tmp/site/bin:$MCBIN:$PATH PYTHONPATH=$PWD/src:$PYTHONPATH  # the tree's code first
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gm
bash scripts/gpu/mc_up.sh | grep -v config
for ((i = 0; i < ${MODEL_WAIT:-150}; i++)); do [ -f /tmp/model/config.json ] && break; sleep 1; done
echo "[multi] model ready after ${i}s; RDMA devices: $(ls /sys/class/infiniband 2>/dev/null | wc -l)"
# what the checker says about the seed's MultiConnector deployment on this host (MCV-E105, MCV-W031)
python3 -c "import sys; from mooncake_vllm.cli import main; sys.exit(main())" check --probe \
  --target-vllm "$(python3 -c 'from importlib.metadata import version; print(version("vllm"))')" \
  tests/checker/data/seed_v1/xpyd.sh tests/checker/data/seed_v1/kv_both.sh > "$OUT/check.txt" 2>&1
grep -E "MCV-(E105|W031)" "$OUT/check.txt"
nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader -l 2 > "$OUT/smi.log" 2>&1 &
smi=$!
TMPDIR=/tmp/gm timeout -s KILL ${MULTI_TIMEOUT:-540} python3 bench/bench_gpu_multi.py --model /tmp/model \
  --out "$OUT/multi.json" ${MULTI_ARGS:-} 2>&1 | grep -v "^[EWI][0-9]\{4\} " | grep -E "^\[multi\]|^\||FAILED|Error" \
  | cut -c1-600
echo "[multi] bench rc=${PIPESTATUS[0]}"
kill $smi 2>/dev/null
python3 -c "import json,sys; sys.path.insert(0,'bench'); from bench_gpu_multi import summarize; \
print(summarize(json.load(open('$OUT/multi.json'))))" > "$OUT/multi_table.md" 2>&1; cat "$OUT/multi_table.md"
tar -czf "$OUT/multi_logs.tgz" -C /tmp gm mc/master.log mc/holder.log 2>/dev/null
free -g | head -2; tail -2 "$OUT/smi.log"
