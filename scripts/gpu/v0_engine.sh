#!/usr/bin/env bash
# Issue 25 on the GPU machine: the legacy V0 engine (vLLM 0.10.0, torch 2.7.1+cu126 from
# make_v0_engine_bundle.sh, unpacked by v0_take.sh into V0_SITE) serves from the pool, and vLLM
# 0.24's V1 (the image's torch, install.sh's b1 + b2) reads the blocks V0 wrote.
#   bash scripts/gpu/v0_engine.sh [STEP ...]     steps: stack a b c table tests (default: all)
# stack: etcd + mooncake_master (port 50001, the seed's) + 4 holders, all Mooncake 0.3.13.post1
#        non-CUDA (the build the CPU suite runs; the V0 and the V1 process take it too: the staged
#        path needs host memory only, and one Mooncake version serves the whole sitting);
#        /tmp/mc/seed.json = the seed's v0/mooncake-tcp.json as written (loopback addresses),
#        /tmp/mc/seed-client.json = the same + "global_segment_size": "0"
# a:     V0 instance A (seed-client.json: a pure client, so its blocks outlive it) computes 2k/8k
#        prompts (recompute; saves), then serves each again (in-HBM prefix hit); exits
# b:     a fresh V0 instance B (seed.json as written) serves them: a pool hit skips the forward
# c:     vLLM 0.24 V1 (seed.json, load_policy always) serves them from the pool, then again
#        (its own in-HBM hit): token-identical?
# table: bench_gpu_ttft.py --summarize-v0; tests: the `v0` tests on CUDA, real V0 classes
# Outputs in $OUT: v0_table.md, v0_runs.tgz (JSON + logs), v0-gpu.xml.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; R=/tmp/res_v0; mkdir -p "$OUT" "$R"
S=${V0_SITE:-/tmp/v0site}
LENGTHS=${V0_LENGTHS:-2048,8000}
steps=${*:-stack a b c table tests}
SRC=$PWD/src
# V0 processes: only our tree, the project's dist-info (its entry point) and the V0 site; the
# loader path without the image's CUDA 13 libraries (cuDNN/NCCL share sonames with the cu12 ones)
V0_PATH=$SRC:/tmp/v0proj:$S
V0_LD=/tmp/xlib
run_step() { echo "=== $1 $(date +%T)"; }

wait_unpacked() {
  local g t=0
  for g in torch wheels; do
    while [ ! -e "$S/.$g-done" ]; do
      [ $t -ge "${V0_UNPACK_WAIT:-300}" ] && { echo "NOT UNPACKED: $g ($(cat /tmp/v0parts/$g.log 2>/dev/null))"; return 1; }
      sleep 1; t=$((t + 1))
    done
  done
  echo "all groups unpacked (waited ${t}s): $(cat "$S"/.*-done | tr '\n' ';')"
}

prepare() {
  wait_unpacked || return 1
  if [ ! -f /tmp/v0proj/.done ] || [ .carry/proj -nt /tmp/v0proj/.done ]; then
    rm -rf /tmp/v0proj
    python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/v0proj .carry/proj/*.whl \
      && touch /tmp/v0proj/.done
  fi
  # the V1 process takes the same Mooncake (0.3.13.post1, non-CUDA) from here, ahead of /tmp/site's
  if [ ! -d /tmp/mc0313/mooncake ]; then
    mkdir -p /tmp/mc0313 && cp -a "$S"/mooncake "$S"/mooncake_transfer_engine* /tmp/mc0313/
  fi
  mkdir -p "$S/bin"; cp -p "${V0_WHEELS:-/tmp/v0wheels}/bin/etcd" "$S/bin/etcd" 2>/dev/null
  printf '#!/bin/sh\nexec python3 -c "import sys; from mooncake.http_metadata_server import main; sys.exit(main())" "$@"\n' \
    > "$S/bin/mooncake_http_metadata_server" && chmod +x "$S/bin/mooncake_http_metadata_server"
}

instance() {  # instance NAME ENGINE CONFIG ARGS...: one bench process, killed at RUN_TIMEOUT
  local name=$1 engine=$2 cfg=$3; shift 3
  local pypath=$V0_PATH ld=$V0_LD v1=0
  if [ "$engine" = v1 ]; then pypath=$SRC:/tmp/mc0313:/tmp/site; ld=$LD_LIBRARY_PATH; v1=1; fi
  run_step "$name ($engine, $(basename "$cfg"))"
  setsid env VLLM_USE_V1=$v1 PYTHONPATH="$pypath" LD_LIBRARY_PATH="$ld" MOONCAKE_CONFIG_PATH="$cfg" \
    timeout -s KILL "${RUN_TIMEOUT:-240}" python3 bench/bench_gpu_ttft.py --mode ours \
    --lengths "$LENGTHS" --max-len 16384 --out "$R/$name.json" "$@" > "$R/$name.log" 2>&1 &
  local pid=$!; wait $pid; echo "rc=$?"; kill -9 -- -$pid 2>/dev/null
  grep -E "^RUN|^ERROR|mooncake-vllm|Traceback|Error|rror:|KV cache|Using .* backend|torch [0-9]" "$R/$name.log" \
    | grep -v "^[EWI][0-9]\{4\} " | cut -c1-300 | head -24
}

for step in $steps; do
  case $step in
    stack)
      prepare || exit 1
      MC_METADATA=etcd MC_MASTER_PORT=50001 MCBIN=$S/mooncake ETCD_BIN=${V0_WHEELS:-/tmp/v0wheels}/bin/etcd \
        LD_LIBRARY_PATH=$V0_LD bash scripts/gpu/mc_up.sh || exit 1
      for _ in $(seq 240); do [ -f /tmp/model/config.json ] && break; sleep 1; done
      ls /tmp/model ;;
    a) instance v0_A v0 /tmp/mc/seed-client.json --phase A --again ;;
    b) instance v0_B v0 /tmp/mc/seed.json --phase B ;;
    c) # /tmp/site's cuda13 Mooncake would be a second Mooncake distribution on the V1 path
      mkdir -p /tmp/mc0314 && mv /tmp/site/mooncake_transfer_engine_cuda13-*.dist-info /tmp/mc0314/ 2>/dev/null
      instance v1_C v1 /tmp/mc/seed.json --phase C --again --extra '{"load_policy": "always"}'
      mv /tmp/mc0314/* /tmp/site/ 2>/dev/null ;;
    table) python3 bench/bench_gpu_ttft.py --summarize-v0 "$R" | tee "$OUT/v0_table.md"
      cp /tmp/mc/*.json "$R/" 2>/dev/null; tar -czf "$OUT/v0_runs.tgz" -C /tmp res_v0 mc/master.log 2>/dev/null ;;
    tests)
      run_step "the v0 tests on CUDA (vLLM 0.10.0, torch 2.7.1)"
      ( unset MOONCAKE_CONFIG_PATH
        PYTHONPATH=$V0_PATH LD_LIBRARY_PATH=$V0_LD PATH=$S/bin:$S/mooncake:$PATH \
          timeout "${V0_TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -o addopts="" \
          -m v0 tests/v0 tests/contract --junitxml="$OUT/v0-gpu.xml" -o junit_suite_name=vllm-0.10.0 2>&1 \
          | grep -v "^[EWI][0-9]\{4\} " | tail -25 ) ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
