#!/usr/bin/env bash
# Build this project's wheel (pure Python) from the current working tree into .carry/b1/ and
# .carry/proj/ (the same file), replacing any older one. Run here, just before the GPU calls: the code
# changes between calls. b1 takes it along on the first call; after that, carry .carry/proj (0.2 MiB)
# to bring a newer wheel without b1's 47 MiB: install.sh prefers .carry/proj and reinstalls on change.
#   bash scripts/gpu/build_project_wheel.sh
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
out=$root/.carry/b1
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
mkdir -p "$root/.carry/proj"
rm -f "$root/.carry/proj"/mooncake_vllm-*.whl
cp -p "$out"/mooncake_vllm-*.whl "$root/.carry/proj/"
ls -l "$out"/mooncake_vllm-*.whl "$root/.carry/proj"/mooncake_vllm-*.whl
