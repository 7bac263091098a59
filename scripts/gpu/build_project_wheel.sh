#!/usr/bin/env bash
# Build this project's wheel (pure Python) from the current working tree into .carry/proj/, replacing
# any older one. Run here, just before the GPU calls: the code changes between calls. Carry
# .carry/proj (0.4 MiB) with any bundle: install.sh installs it and reinstalls it when it changed.
#   bash scripts/gpu/build_project_wheel.sh
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=$root/.carry/proj
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# a clean copy of what git would send (tracked + untracked-not-ignored): no stale build/ or egg-info
(cd "$root" && git ls-files -z -c -o --exclude-standard | while IFS= read -r -d '' f; do
   [ -e "$f" ] && printf '%s\0' "$f"; done | xargs -0 cp --parents -t "$tmp")
py=python3
[ -x "$root/.venv/bin/python" ] && py=$root/.venv/bin/python
rm -f "$out"/mooncake_vllm-*.whl
if ! "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$tmp" 2>"$tmp.err"; then
  echo "no-build-isolation build failed ($(tail -1 "$tmp.err")); trying an isolated build" >&2
  "$py" -m pip wheel -q --no-deps -w "$out" "$tmp"
fi
rm -f "$tmp.err"
ls -l "$out"/mooncake_vllm-*.whl
