#!/usr/bin/env bash
# Issue 25: the whole vLLM 0.10.0 V0 engine for the GPU machine, as pieces one call each can carry.
# Here (network to the package registries): vllm==0.10.0 with its real dependency closure for
# cp312 — torch 2.7.1+cu126 and the nvidia-*-cu12 libraries, torchvision 0.22.1, and
# mooncake-transfer-engine-non-cuda 0.3.13.post1 (the build our CPU suite runs; no 0.3.14 is
# published but -cuda13, and plain mooncake-transfer-engine is the CUDA 12 build) — pinned to the
# versions our vllm-0.10.0 contract env runs (transformers 4.54.0, ...: an unpinned resolve takes
# transformers 5.x, which 0.10.0 predates). Installed with python3.12 into STAGE/site, trimmed
# (see TRIM), packed per group as .tar.xz, split into PIECE-byte pieces, each in its own folder
# .carry/v0pNN (one `carry` entry per device call), with MANIFEST (sha256 of every piece and every
# whole archive) in .carry/v0p00. The etcd server binary (the etcd-server .deb's, static) travels
# in the `rest` group as bin/etcd.
# On the GPU machine scripts/gpu/v0_take.sh checks and assembles them.
#   bash scripts/gpu/make_v0_engine_bundle.sh          (~40 min on 2 cores: xz -6 of ~5 GB)
# Knobs: STAGE (/work/v0stage), PY312 (a python3.12 for pip --target), PIECE (58720256 = 56 MiB:
# a call carries 64 MiB with the ~6 MB working tree),
# XZ_LEVEL (6). Steps whose output exists are skipped (delete STAGE to redo).
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
STAGE=${STAGE:-/work/v0stage}
PY312=${PY312:-$(command -v python3.12 || ls /root/.pyenv/versions/3.12*/bin/python3.12 | head -1)}
PIECE=${PIECE:-58720256}
XZ_LEVEL=${XZ_LEVEL:-6}
contract_env=${V0_CONTRACT_ENV:-$HOME/.cache/mooncake-vllm/envs/vllm-0.10.0}
mkdir -p "$STAGE"
grep -qx '/.carry/' "$root/.git/info/exclude" 2>/dev/null || echo '/.carry/' >> "$root/.git/info/exclude"

# 1. download: the contract env's versions as constraints
if [ ! -f "$STAGE/dl.done" ]; then
  site=$(ls -d "$contract_env"/lib/python3*/site-packages | head -1)
  ls "$site" | sed -n 's/\.dist-info$//p' | awk -F- '{print $1"=="$2}' \
    | grep -v -i -E '^(torch|vllm|mooncake|triton|nvidia|_)' > "$STAGE/constraints.txt"
  plat=""; for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux_2_5 \
                    manylinux2014 manylinux1; do plat="$plat --platform ${p}_x86_64"; done
  # shellcheck disable=SC2086
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    -c "$STAGE/constraints.txt" -d "$STAGE/dl" vllm==0.10.0 torchvision==0.22.1 \
    mooncake-transfer-engine-non-cuda==0.3.13.post1
  touch "$STAGE/dl.done"
fi

# 2. install for cp312, without ray / cupy (ray's compiled-graph extra: multi-node only) and
#    xformers (V0 on Hopper selects FLASH_ATTN)
if [ ! -f "$STAGE/site.done" ]; then
  rm -rf "$STAGE/site"
  # shellcheck disable=SC2046
  "$PY312" -m pip install -q --no-index --no-deps --no-compile --target "$STAGE/site" \
    $(ls "$STAGE"/dl/*.whl | grep -v -E '/(ray|cupy_cuda12x|xformers)-')
  touch "$STAGE/site.done"
fi

# 3. TRIM: what no V0 serving process loads. cv2/scipy/numba/llvmlite: only imported by features
#    not used here (video, spec-decode n-gram); the image has its own if anything asks. Mooncake's
#    process-group/EP plugins and its benchmark; torch's C++ headers (no extension is built);
#    triton's static CUPTI; cuBLAS's nvblas, cuFFT's fftw shim, cuSOLVER's multi-GPU library
#    (no DT_NEEDED of torch or vLLM names them).
cd "$STAGE/site"
rm -rf cv2 opencv_python_headless* scipy scipy-* scipy.libs numba numba-* llvmlite llvmlite-* \
  torch/include triton/backends/nvidia/lib/cupti/libcupti_static.a \
  nvidia/cublas/lib/libnvblas.so.12 nvidia/cufft/lib/libcufftw.so.11 \
  nvidia/cusolver/lib/libcusolverMg.so.11 \
  mooncake/_ep*.so mooncake/libmooncake_ep_device.so mooncake/libmooncake_pg*.so \
  mooncake/pg_2_*.so mooncake/transfer_engine_bench
find . -name __pycache__ -prune -exec rm -rf {} +
mkdir -p bin && cp "$(command -v etcd)" bin/etcd

# 4. pack per group (unpacked in parallel there), split, manifest
out=$root/.carry
mkdir -p "$STAGE/packs"
members() {  # the top-level entries of one group
  case $1 in
    torch) ls -d torch torch-* torchgen functorch 2>/dev/null ;;
    cudnn) ls -d nvidia_cudnn* ;;
    nvidia) ls -d nvidia cusparselt nvidia_* | grep -v '^nvidia_cudnn' ;;
    vllm) ls -d vllm vllm-* ;;
    rest) ls -A | grep -v -E '^(torch|torch-.*|torchgen|functorch|nvidia|nvidia_.*|cusparselt|vllm|vllm-.*)$' ;;
  esac
}
for g in torch cudnn nvidia vllm rest; do
  a=$STAGE/packs/$g.tar.xz
  [ -s "$a" ] && continue
  excl=(); [ "$g" = nvidia ] && excl=(--anchored --exclude=nvidia/cudnn)
  [ "$g" = cudnn ] && set -- nvidia/cudnn || set --
  # shellcheck disable=SC2046
  tar -C "$STAGE/site" "${excl[@]}" -cf - "$@" $(members "$g") | xz -"$XZ_LEVEL" -T2 > "$a.tmp"
  mv "$a.tmp" "$a"
  echo "packed $g: $(stat -c %s "$a") bytes"
done
rm -rf "$out"/v0p[0-9]*
mkdir -p "$out/v0p00"
n=1
: > "$out/v0p00/MANIFEST"
for g in torch cudnn nvidia vllm rest; do
  a=$STAGE/packs/$g.tar.xz
  echo "archive $g.tar.xz $(sha256sum "$a" | cut -d' ' -f1) $(stat -c %s "$a")" >> "$out/v0p00/MANIFEST"
  split -b "$PIECE" -d -a 2 "$a" "$STAGE/packs/$g.part."
  for p in "$STAGE"/packs/"$g".part.*; do
    d=$(printf '%s/v0p%02d' "$out" "$n")
    mkdir -p "$d"; mv "$p" "$d/"
    echo "piece $(basename "$d") $(basename "$p") $(sha256sum "$d/$(basename "$p")" | cut -d' ' -f1)" \
      >> "$out/v0p00/MANIFEST"
    n=$((n + 1))
  done
done
echo "$((n - 1)) pieces + v0p00 (manifest, etcd) in $out"
du -sh "$out"/v0p00 "$STAGE/packs"
