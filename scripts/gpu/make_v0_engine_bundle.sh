#!/usr/bin/env bash
# Issue 25: the whole vLLM 0.10.0 V0 engine for the GPU machine, as pieces one call each can carry.
# Here (network to the package registries): vllm==0.10.0 with its real dependency closure for
# cp312 — torch 2.7.1+cu126 and the nvidia-*-cu12 libraries, torchvision 0.22.1, and
# mooncake-transfer-engine-non-cuda 0.3.13.post1 (the build our CPU suite runs; no 0.3.14 is
# published but -cuda13, and plain mooncake-transfer-engine is the CUDA 12 build) — pinned to the
# versions our vllm-0.10.0 contract env runs (transformers 4.54.0, ...: an unpinned resolve takes
# transformers 5.x, which 0.10.0 predates). Installed with python3.12 into STAGE/site, trimmed
# (step 3 says what travels how), split into PIECE-byte pieces, each in its own folder .carry/v0pNN
# (one `carry` entry per device call), with MANIFEST (sha256 of every piece and every whole
# archive) in .carry/v0p00. The etcd server binary (the etcd-server .deb's, static) travels too.
# On the GPU machine scripts/gpu/v0_take.sh checks and assembles them.
#   bash scripts/gpu/make_v0_engine_bundle.sh          (~25 min on 2 cores: xz -6 of torch)
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
    mooncake-transfer-engine-non-cuda==0.3.13.post1 "xxhash>=3"  # + this project's own needs
  touch "$STAGE/dl.done"
fi

# 2. install torch for cp312 (repacked from this tree in step 3; the rest travels as wheels)
if [ ! -f "$STAGE/site.done" ]; then
  rm -rf "$STAGE/site"
  "$PY312" -m pip install -q --no-index --no-deps --no-compile --target "$STAGE/site" \
    "$STAGE"/dl/torch-*.whl
  touch "$STAGE/site.done"
fi

# 3. what travels: torch (1.6 GB unpacked) repacked as .tar.xz from the pip-installed tree, minus
#    its C++ headers (no extension is built there): xz -6 takes it to ~60 % of the wheel's deflate;
#    every other wheel as it is (already deflated; recompressing 2 GB more with xz costs over an
#    hour on 2 cores for ~10 pieces), in one plain tar with the etcd server, installed there by
#    carry_tool.py install-wheels in parallel. Left out: ray / cupy (ray's compiled-graph extra:
#    multi-node only), xformers (V0 on Hopper selects FLASH_ATTN), opencv / scipy / numba /
#    llvmlite (only video, audio and V1's n-gram drafts import them; the image has its own).
out=$root/.carry
packs=$STAGE/packs
mkdir -p "$packs"
if [ ! -s "$packs/torch.tar.xz" ]; then
  rm -rf "$STAGE/site/torch/include"
  (cd "$STAGE/site" && find torch torchgen functorch -name __pycache__ -prune -exec rm -rf {} +
   tar -cf - torch torch-*.dist-info torchgen functorch) | xz -"$XZ_LEVEL" -T2 > "$packs/torch.tar.xz.tmp"
  mv "$packs/torch.tar.xz.tmp" "$packs/torch.tar.xz"
fi
if [ ! -s "$packs/wheels.tar" ]; then
  rm -rf "$STAGE/wheels" && mkdir -p "$STAGE/wheels/bin"
  ls "$STAGE"/dl/*.whl | grep -v -E '/(torch|ray|cupy_cuda12x|xformers|opencv_python_headless|scipy|numba|llvmlite)-' \
    | xargs -I{} ln {} "$STAGE/wheels/"
  cp "$(command -v etcd)" "$STAGE/wheels/bin/etcd"
  tar -C "$STAGE/wheels" -cf "$packs/wheels.tar.tmp" . && mv "$packs/wheels.tar.tmp" "$packs/wheels.tar"
fi

# 4. split, manifest (`archive NAME SHA256 BYTES`, `piece FOLDER FILE SHA256`)
rm -rf "$out"/v0p[0-9]*
mkdir -p "$out/v0p00"
n=1
: > "$out/v0p00/MANIFEST"
for a in "$packs/torch.tar.xz" "$packs/wheels.tar"; do
  g=$(basename "$a"); g=${g%%.*}
  echo "archive $(basename "$a") $(sha256sum "$a" | cut -d' ' -f1) $(stat -c %s "$a")" >> "$out/v0p00/MANIFEST"
  split -b "$PIECE" -d -a 2 "$a" "$packs/$g.part."
  for p in "$packs/$g".part.*; do
    d=$(printf '%s/v0p%02d' "$out" "$n")
    mkdir -p "$d"; mv "$p" "$d/"
    echo "piece $(basename "$d") $(basename "$p") $(sha256sum "$d/$(basename "$p")" | cut -d' ' -f1)" \
      >> "$out/v0p00/MANIFEST"
    n=$((n + 1))
  done
done
echo "$((n - 1)) pieces + v0p00 (MANIFEST) in $out"
du -sh "$packs"/*
