#!/usr/bin/env bash
# On the GPU machine, from the repo root, once b1 and b2 are installed (install.sh): issue 12's
# interference + hit TTFT bench, every mode in one run (bench/bench_gpu_interference.py).
#   bash scripts/gpu/interference.sh [BENCH_SCRIPT] [PROJECT_WHEEL]
# The model: /tmp/model (scripts/gpu/make_model.py, which may still be writing it: waits up to
# MODEL_WAIT s). The pool: mc_up.sh (reuses a running one). BENCH_ARGS: extra bench options.
set -uo pipefail
source scripts/gpu/env.sh
export PATH=/tmp/site/bin:$MCBIN:$PATH PYTHONPATH=$PWD/src:$PYTHONPATH  # the tree's code first
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gi
bench=${1:-bench/bench_gpu_interference.py}
if [ -n "${2:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --disable-pip-version-check \
    --target /tmp/site "$2" && echo "[gi] project wheel $(basename "$2") installed"
fi
bash scripts/gpu/mc_up.sh | grep -v config
for ((i = 0; i < ${MODEL_WAIT:-150}; i++)); do [ -f /tmp/model/config.json ] && break; sleep 1; done
echo "[gi] model ready after ${i}s: $(tail -2 /tmp/make_model.log 2>/dev/null | head -1)"
nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader -l 2 > "$OUT/smi.log" 2>&1 &
smi=$!
TMPDIR=/tmp/gi python3 "$bench" --model /tmp/model --out "$OUT/interference.json" ${BENCH_ARGS:-}
echo "[gi] bench rc=$?"
kill $smi 2>/dev/null
tar -czf "$OUT/logs.tgz" -C /tmp gi mc/master.log mc/holder.log 2>/dev/null
free -g | head -2; tail -3 "$OUT/smi.log"
