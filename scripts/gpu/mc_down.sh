#!/usr/bin/env bash
# Stop what mc_up.sh started, by pid only: the holders first, then the master, then etcd (TERM, then KILL
# after 5 s).
MC=${MC_DIR:-${GPU_PREFIX:-/tmp}/mc}
holders=$(cd "$MC" 2>/dev/null && ls holder*.pid 2>/dev/null | sed 's/\.pid$//')
for p in $holders master etcd; do
  f=$MC/$p.pid
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null; echo "[mc_down] $p pid $pid killed"
    else echo "[mc_down] $p pid $pid stopped"; fi
  fi
  rm -f "$f"
done
true
