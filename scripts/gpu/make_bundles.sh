#!/usr/bin/env bash
# Build, here, the bundles that carry vLLM 0.24.0 + Mooncake (cuda13 0.3.14) + system libraries to the
# GPU machine: .carry/b1 .carry/b4 .carry/b2 (.carry/b3 = optional fallback), each small enough to travel
# with the repo's tracked tree (~15 MiB) under the 64 MiB a call carries. Idempotent: a
# finished archive is kept; delete .carry/bN (or .carry/stage) to redo. Needs pip, apt-get, xz here.
#   bash scripts/gpu/make_bundles.sh            # then: bash scripts/gpu/build_project_wheel.sh
#
#   b1  site-mooncake.tar.xz   mooncake-transfer-engine-cuda13 0.3.14, trimmed      -> /tmp/site
#       debroot.tar.xz         libibverbs/mlx5, libnuma, libcurl + closure (dpkg -x) -> /tmp/debroot
#   b4  site-deps.tar.xz       vLLM's missing Python deps, installed --target here  -> /tmp/site
#       site-vllm-py.tar.xz    vLLM 0.24.0 without the two big kernel libraries     -> /tmp/site
#       site-vllm-fa3.tar.xz   vllm_flash_attn/_vllm_fa3_C.abi3.so (FA3, the H200 backend)
#   b2  site-vllm-C.tar.xz     _C_stable_libtorch.abi3.so, sm_90-pruned (carry_tool.py fatbin-prune)
#   proj mooncake_vllm-*.whl   this project (build_project_wheel.sh)
#   b3  C.fatpatch             the pruned fatbin images: install.sh rebuilds the original
#                              _C_stable_libtorch byte for byte (sha256-checked). Carry it only if
#                              fatbin-check or a vLLM kernel fails with the pruned library.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
here=$root/scripts/gpu
carry=$root/.carry
stage=${GPU_STAGE:-$carry/stage}
XZ=${XZ:-xz -9e -T2}
grep -qx '/.carry/' "$(git -C "$root" rev-parse --git-path info/exclude)" 2>/dev/null \
  || echo '/.carry/' >> "$(git -C "$root" rev-parse --git-path info/exclude)"
mkdir -p "$stage"/{dl,deps-whl} "$carry"/{b1,b2,b3}
say() { printf '[bundles %s] %s\n' "$(date +%T)" "$*"; }
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
         manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 \
         manylinux_2_5 manylinux1; do PLAT+=(--platform ${p}_x86_64); done
PLAT+=(--platform any)
py=python3
pipq() { "$py" -m pip "$@" 2>&1 | grep -v -e '^WARNING: Location' -e 'Running pip as the' || true; }

# ---- downloads (--no-deps: every wheel is named in deps-vllm-0.24.0.txt)
VLLM_WHL=$stage/dl/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
MC_WHL=$stage/dl/mooncake_transfer_engine_cuda13-0.3.14-cp312-cp312-manylinux_2_28_x86_64.whl
[ -f "$VLLM_WHL" ] || pipq download -q --no-deps "${PLAT[@]}" -d "$stage/dl" vllm==0.24.0
[ -f "$MC_WHL" ] || pipq download -q --no-deps "${PLAT[@]}" -d "$stage/dl" mooncake-transfer-engine-cuda13==0.3.14
pipq download -q --no-deps "${PLAT[@]}" -d "$stage/deps-whl" -r "$here/deps-vllm-0.24.0.txt"
n=$(ls "$stage/deps-whl"/*.whl | wc -l); want=$(grep -c '^[A-Za-z].*==' "$here/deps-vllm-0.24.0.txt")
[ "$n" = "$want" ] || { echo "expected $want dep wheels in $stage/deps-whl, found $n (stale extra ones?)"; exit 1; }

# ---- b1: mooncake (no bench binary, no torch process-group / expert-parallel libs or JIT sources)
if [ ! -f "$carry/b1/site-mooncake.tar.xz" ]; then
  say "mooncake tree"
  rm -rf "$stage/mc" && mkdir -p "$stage/mc"
  (cd "$stage/mc" && unzip -q "$MC_WHL" \
     -x 'mooncake/transfer_engine_bench' 'mooncake/libmooncake_pg.so' 'mooncake/libmooncake_pg_device.so' \
        'mooncake/_ep.cpython-312-x86_64-linux-gnu.so' 'mooncake/libmooncake_ep_device.so' \
        'mooncake/mooncake_ep_jit/*' 'mooncake/_pg_jit/*')
  chmod +x "$stage/mc/mooncake/mooncake_master" "$stage/mc/mooncake/mooncake_client"
  tar -C "$stage/mc" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | $XZ > "$carry/b1/site-mooncake.tar.xz.tmp"
  mv "$carry/b1/site-mooncake.tar.xz.tmp" "$carry/b1/site-mooncake.tar.xz"
fi
# ---- b1: deps, installed here exactly as pip would there (cp312 wheels, --no-deps, --no-compile)
if [ ! -f "$carry/b1/site-deps.tar.xz" ] && [ ! -f "$carry/b4/site-deps.tar.xz" ]; then
  say "deps tree"
  rm -rf "$stage/deps-site"
  pipq install -q --no-index --no-deps --no-compile "${PLAT[@]}" --target "$stage/deps-site" "$stage/deps-whl"/*.whl
  rm -rf "$stage/deps-site/bin"   # console scripts with this machine's interpreter in their shebang
  tar -C "$stage/deps-site" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | $XZ > "$carry/b1/site-deps.tar.xz.tmp"
  mv "$carry/b1/site-deps.tar.xz.tmp" "$carry/b1/site-deps.tar.xz"
fi
# ---- b1: system libraries the GPU image lacks, with their closure (what ldconfig there already has
# is not linked: install.sh links only missing sonames into /tmp/xlib)
DEBS="ibverbs-providers libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 libbrotli1 libcom-err2
 libdb5.3 libffi8 libgmp10 libgnutls30 libgssapi-krb5-2 libhogweed6 libidn2-0 libk5crypto3 libkeyutils1
 libkrb5-3 libkrb5support0 libldap-2.5-0 libnettle8 libnghttp2-14 libp11-kit0 libpsl5 librtmp1 libsasl2-2
 libsasl2-modules-db libssh2-1 libssl3 libtasn1-6 libunistring2 libzstd1"
if [ ! -f "$carry/b1/debroot.tar.xz" ]; then
  say "debs"
  rm -rf "$stage/debs" "$stage/debroot" && mkdir -p "$stage/debs" "$stage/debroot"
  (cd "$stage/debs" && apt-get download $DEBS >/dev/null 2>"$stage/debs.err") || { cat "$stage/debs.err"; exit 1; }
  for d in "$stage/debs"/*.deb; do dpkg -x "$d" "$stage/debroot"; done
  rm -rf "$stage/debroot/usr/share/doc" "$stage/debroot/usr/share/man" "$stage/debroot/usr/share/locale" \
         "$stage/debroot/usr/share/lintian"
  ls "$stage/debs" > "$stage/debroot/DEBS.txt"
  tar -C "$stage/debroot" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | $XZ > "$carry/b1/debroot.tar.xz.tmp"
  mv "$carry/b1/debroot.tar.xz.tmp" "$carry/b1/debroot.tar.xz"
fi

# ---- b2: vLLM, trimmed (see scripts/gpu/README.md for what goes and why)
if { [ ! -f "$carry/b2/site-vllm-py.tar.xz" ] && [ ! -f "$carry/b4/site-vllm-py.tar.xz" ]; } \
   || { [ ! -f "$carry/b2/site-vllm-fa3.tar.xz" ] && [ ! -f "$carry/b4/site-vllm-fa3.tar.xz" ]; } \
   || [ ! -f "$carry/b2/site-vllm-C.tar.xz" ] || [ ! -f "$carry/b3/C.fatpatch" ]; then
  say "vllm tree"
  V=$stage/vllm && rm -rf "$V" "$stage/vllm-fa3" "$stage/vllm-C" && mkdir -p "$V" "$stage/vllm-fa3/vllm/vllm_flash_attn" "$stage/vllm-C/vllm"
  (cd "$V" && unzip -q "$VLLM_WHL" \
     -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/_moe_C_stable_libtorch.abi3.so' 'vllm/vllm-rs' \
        'vllm/third_party/deep_gemm/_C.cpython-310-*' 'vllm/third_party/deep_gemm/_C.cpython-311-*' \
        'vllm/third_party/deep_gemm/_C.cpython-313-*' 'vllm/third_party/deep_gemm/_C.cpython-314-*' \
        'vllm/third_party/fmha_sm100/*' 'vllm/_flashmla*' 'vllm/_qutlass_C*')
  mv "$V/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" "$stage/vllm-fa3/vllm/vllm_flash_attn/"
  "$py" "$here/carry_tool.py" fatbin-prune "$V/vllm/_C_stable_libtorch.abi3.so" \
        "$stage/vllm-C/vllm/_C_stable_libtorch.abi3.so" 90 "$carry/b3/C.fatpatch"
  touch -r "$V/vllm/_C_stable_libtorch.abi3.so" "$stage/vllm-C/vllm/_C_stable_libtorch.abi3.so"
  rm "$V/vllm/_C_stable_libtorch.abi3.so"
  for part in py:"$V" fa3:"$stage/vllm-fa3" C:"$stage/vllm-C"; do
    name=${part%%:*} dir=${part#*:}
    x="$XZ"; [ "$name" = C ] && x="xz -9 -T2"   # zstd-compressed cubins: -9e gains nothing there
    tar -C "$dir" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | $x > "$carry/b2/site-vllm-$name.tar.xz.tmp"
    mv "$carry/b2/site-vllm-$name.tar.xz.tmp" "$carry/b2/site-vllm-$name.tar.xz"
  done
fi

# ---- the Python payload moves to b4, so that b1 and b2 each travel with the repo's tracked tree
# (~15 MiB) under the 64 MiB a call carries (b1 + b2 as built were 50 + 48 MiB)
mkdir -p "$carry/b4"
for f in b1/site-deps b2/site-vllm-py b2/site-vllm-fa3; do
  [ -f "$carry/$f.tar.xz" ] && mv "$carry/$f.tar.xz" "$carry/b4/"
done
rm -f "$carry"/b1/mooncake_vllm-*.whl  # the project travels as .carry/proj

# ---- sizes: each bundle must leave room for the repo's tracked tree under the 64 MiB a call carries
# disk usage (whole 4 KiB blocks), as a call's carry is counted, not apparent sizes
tree=$(( $(git -C "$root" ls-files -z | (cd "$root" && xargs -0 du -ck 2>/dev/null) | tail -1 | cut -f1) * 1024 ))
limit=$((64 * 1048576 - tree - 1048576))
ok=1
for b in "$carry"/b[0-9]*; do
  s=$(( $(du -sk "$b" | cut -f1) * 1024 ))
  printf '%s: %6.1f MiB  %s\n' "${b#$root/}" "$(echo "$s" | awk '{print $1/1048576}')" "$(cd "$b" && ls | tr '\n' ' ')"
  [ "$s" -le "$limit" ] || { echo "  ${b#$root/} does not fit beside the tree ($((tree / 1048576)) MiB)"; ok=0; }
done
[ $ok = 1 ]
