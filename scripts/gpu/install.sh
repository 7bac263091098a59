#!/usr/bin/env bash
# On the GPU machine, from the repo root:  bash scripts/gpu/install.sh
# Installs every bundle .carry/bN that this call carried (or an earlier call left there) and that is
# not installed yet, then this project's wheel if it changed. Idempotent: /tmp/site/.bN-done records
# what each installed bundle held, so a second call skips it. One line per step, with seconds.
#   b1: Mooncake + system libraries   b4: Python deps + vLLM 0.24.0's Python and FA3 (b1 + b4 + proj:
#   enough for component tests)   b2: vLLM's _C_stable_libtorch, pruned to sm_90   b3: optional, README
# GPU_PREFIX (default /tmp) relocates site/, debroot/, xlib/ (used to test this script elsewhere);
# GPU_PYTHON (default python3) is the interpreter; GPU_COMPILE=0 skips precompiling .pyc files;
# GPU_CHECK=0 skips the driver check of the pruned _C_stable_libtorch (fatbin-check).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PREFIX=${GPU_PREFIX:-/tmp}
SITE=$PREFIX/site DEBROOT=$PREFIX/debroot XLIB=$PREFIX/xlib
PY=${GPU_PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
TOOL=$ROOT/scripts/gpu/carry_tool.py
CARRY=$ROOT/.carry
mkdir -p "$SITE" "$DEBROOT" "$XLIB"
T_ALL=${EPOCHREALTIME/./}
fail=0

step() {  # step NAME CMD...: run, print seconds and status
  local name=$1; shift
  local t0=${EPOCHREALTIME/./}
  "$@"
  local rc=$?
  local us=$(( ${EPOCHREALTIME/./} - t0 ))
  printf '[install] %-44s %4d.%01ds %s\n' "$name" $((us / 1000000)) $(((us / 100000) % 10)) \
    "$([ $rc = 0 ] && echo ok || echo "FAILED rc=$rc")"
  [ $rc = 0 ] || fail=1
  return $rc
}

link_libs() {  # symlink into xlib, by soname, only the libraries this machine's loader lacks
  local have n=0 so path
  have=$(ldconfig -p 2>/dev/null | awk 'NR > 1 {print $1}' | sort -u)
  while read -r so path; do
    if ! grep -qxF "$so" <<<"$have"; then ln -sfn "$path" "$XLIB/$so"; n=$((n + 1)); fi
  done < <("$PY" "$TOOL" sonames "$DEBROOT/lib/x86_64-linux-gnu" "$DEBROOT/usr/lib/x86_64-linux-gnu")
  echo "  linked $n libraries into $XLIB: $(ls "$XLIB" | tr '\n' ' ')"
}

bundle_sig() { (cd "$1" && find . -maxdepth 1 -type f ! -name 'mooncake_vllm-*.whl' -printf '%f %s\n' | sort); }

install_bundle() {  # install_bundle DIR
  local dir=$1 b jobs=() f
  b=$(basename "$dir")
  for f in "$dir"/site-*.tar.xz; do [ -e "$f" ] && jobs+=("$f=$SITE"); done
  for f in "$dir"/debroot*.tar.xz; do [ -e "$f" ] && jobs+=("$f=$DEBROOT"); done
  if [ ${#jobs[@]} -gt 0 ]; then
    step "$b: unpack ${#jobs[@]} archives in parallel" "$PY" "$TOOL" extract "${jobs[@]}" || return 1
  fi
  if ls "$dir"/debroot*.tar.xz >/dev/null 2>&1; then step "$b: link missing system libraries" link_libs || return 1; fi
  if [ -f "$dir/site-vllm-C.tar.xz" ] && [ "${GPU_CHECK:-1}" = 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
    # the driver loads every fatbin of the sm_90-pruned library that holds sm_90 cubins (~1-2 s)
    step "$b: fatbin-check of the pruned _C_stable_libtorch" "$PY" "$TOOL" fatbin-check \
      "$SITE/vllm/_C_stable_libtorch.abi3.so" \
      || echo "  => the pruned library did not load: carry .carry/b3 next (rebuilds the original, sha256-checked)"
  fi
  if [ -f "$dir/C.fatpatch" ]; then
    if [ ! -f "$SITE/vllm/_C_stable_libtorch.abi3.so" ]; then
      echo "  $b holds C.fatpatch, which patches b2's _C_stable_libtorch: install b2 first"; return 1
    fi
    step "$b: rebuild the unpruned _C_stable_libtorch" "$PY" "$TOOL" fatbin-unprune \
      "$SITE/vllm/_C_stable_libtorch.abi3.so" "$dir/C.fatpatch" "$SITE/vllm/_C_stable_libtorch.abi3.so" || return 1
  fi
  if [ "${GPU_COMPILE:-1}" = 1 ] && ls "$dir"/site-*.tar.xz >/dev/null 2>&1; then
    # bytecode on all cores now, else each first import compiles it on one (up-to-date files are skipped)
    step "$b: precompile /tmp/site (compileall -j0)" \
      bash -c '"$0" -m compileall -q -j0 "$1" >/dev/null 2>&1; true' "$PY" "$SITE"
  fi
  bundle_sig "$dir" > "$SITE/.$b-done"
  local n=${b#b} m  # a later bundle may patch this one's files (b3 patches b2): redo those when present
  for m in "$SITE"/.b*-done; do [ -e "$m" ] && [ "$(basename "$m" -done | tr -dc 0-9)" -gt "$n" ] && rm -f "$m"; done
  return 0
}

for dir in "$CARRY"/b[0-9]*; do
  [ -d "$dir" ] || continue
  b=$(basename "$dir")
  if [ -f "$SITE/.$b-done" ] && [ "$(bundle_sig "$dir")" = "$(cat "$SITE/.$b-done")" ]; then
    echo "[install] $b: installed already, skipped"; continue
  fi
  install_bundle "$dir" || { echo "[install] $b: FAILED"; fail=1; }
done

# this project: .carry/proj (carried alone, tiny) wins over .carry/b1; reinstalled when it changed
whl=$(ls -t "$CARRY"/proj/mooncake_vllm-*.whl 2>/dev/null | head -1)
[ -n "$whl" ] || whl=$(ls -t "$CARRY"/b1/mooncake_vllm-*.whl 2>/dev/null | head -1)
if [ -n "$whl" ]; then
  sum=$(sha256sum "$whl" | cut -c1-64)
  if [ "$sum" != "$(cat "$SITE/.project-wheel" 2>/dev/null)" ]; then
    step "project wheel $(basename "$whl")" "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --upgrade --disable-pip-version-check --target "$SITE" "$whl" \
      && echo "$sum" > "$SITE/.project-wheel"
  else
    echo "[install] project wheel unchanged ($(basename "$whl"))"
  fi
fi

# what is there now (cheap: no heavy import)
GPU_PREFIX=$PREFIX source "$ROOT/scripts/gpu/env.sh"
"$PY" - "$SITE" <<'PY'
import importlib.metadata as md, sys
site = sys.argv[1]
names = ["vllm", "mooncake-transfer-engine-cuda13", "mooncake-vllm", "torch", "transformers", "pydantic",
         "fastapi", "openai", "xgrammar"]
got = []
for n in names:
    try:
        d = md.distribution(n)
        where = "carried" if str(d.locate_file("")).startswith(site) else "image"
        got.append(f"{n} {d.version} ({where})")
    except md.PackageNotFoundError:
        got.append(f"{n} -")
print("[install] versions:", "; ".join(got))
PY
if [ -x "$MCBIN/mooncake_master" ]; then
  miss=$(for f in "$MCBIN/mooncake_master" "$MCBIN/mooncake_client" "$MCBIN"/_store.*.so; do ldd "$f" 2>/dev/null; done | grep 'not found' | sort -u | tr -s ' \t\n' ' ')
  if [ -z "$miss" ]; then echo "[install] mooncake binaries: every library resolves"
  elif [ "$miss" = " libcuda.so.1 => not found " ]; then echo "[install] mooncake: libcuda.so.1 not found (no GPU driver here?)"
  else echo "[install] mooncake: MISSING $miss"; fail=1; fi
fi
for n in 1 4 2; do
  [ -f "$SITE/.b$n-done" ] || echo "[install] NOTE: b$n is not installed on this machine (a fresh one, or b$n never carried): carry .carry/b$n"
done
us=$(( ${EPOCHREALTIME/./} - T_ALL ))
echo "[install] done in $((us / 1000000)).$(((us / 100000) % 10))s$([ $fail = 0 ] || echo ' WITH FAILURES')"
exit $fail
