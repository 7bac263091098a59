#!/usr/bin/env bash
# On the GPU machine: start mooncake_master + a standalone holder (mooncake_client owning the pool's
# memory) on 127.0.0.1, unless they already run; write the client config. Logs and pids in /tmp/mc.
#   bash scripts/gpu/mc_up.sh        (after install.sh; stop with mc_down.sh)
# Both run in their own session (setsid), so they outlive this call and serve the next calls while the
# machine stays warm; mc_down.sh stops them by pid. Env knobs: MC_SEGMENT (holder's global segment,
# bytes, default 16 GiB), MC_MASTER_PORT (50051), MC_METRICS_PORT (9003), MC_HOLDER_PORT (50052),
# MC_WAIT (seconds to wait for each, 30).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/env.sh"
MC=${MC_DIR:-${GPU_PREFIX:-/tmp}/mc}
SEG=${MC_SEGMENT:-17179869184}
PORT=${MC_MASTER_PORT:-50051} METRICS=${MC_METRICS_PORT:-9003} HPORT=${MC_HOLDER_PORT:-50052}
WAIT=${MC_WAIT:-30}
mkdir -p "$MC"
t0=${EPOCHREALTIME/./}
secs() { local us=$(( ${EPOCHREALTIME/./} - t0 )); echo "$((us / 1000000)).$(((us / 10000) % 100))s"; }
alive() { [ -f "$MC/$1.pid" ] && kill -0 "$(cat "$MC/$1.pid")" 2>/dev/null; }
tcp_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
metrics() {  # GET /metrics from the master with bash alone (no curl there)
  (exec 3<>"/dev/tcp/127.0.0.1/$METRICS" || exit 1
   printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
   timeout 2 cat <&3) 2>/dev/null
}
capacity() { metrics | awk '$1 == "master_total_capacity_bytes" {printf "%d", $2; f=1} END {if (!f) print 0}'; }
start() {  # start NAME CMD...: own session, pid file = the program's own pid
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$MC/$1.pid" "${@:2}" >> "$MC/$1.log" 2>&1 < /dev/null &
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s "$MC/$1.pid" ] && break; sleep 0.01; done
}

cat > "$MC/config.json" <<JSON
{"metadata_server":"P2PHANDSHAKE","global_segment_size":"0","local_buffer_size":"1GB","protocol":"tcp","device_name":"","master_server_address":"127.0.0.1:$PORT","mode":"standalone-store"}
JSON

if alive master; then
  echo "[mc_up] master already running (pid $(cat "$MC/master.pid"))"
else
  rm -f "$MC/master.pid"
  start master "$MCBIN/mooncake_master" --rpc_address=127.0.0.1 --rpc_port="$PORT" \
    --metrics_host=127.0.0.1 --metrics_port="$METRICS"
  for ((i = 0; i < WAIT * 20; i++)); do tcp_open "$PORT" && break; alive master || break; sleep 0.05; done
  if ! tcp_open "$PORT"; then
    echo "[mc_up] MASTER NOT UP after $(secs)"; tail -20 "$MC/master.log"; exit 1
  fi
  echo "[mc_up] master pid $(cat "$MC/master.pid") accepts on 127.0.0.1:$PORT after $(secs)"
fi

if alive holder; then
  echo "[mc_up] holder already running (pid $(cat "$MC/holder.pid")), master capacity gauge $(capacity) bytes"
else
  rm -f "$MC/holder.pid"
  mark=$(wc -l < "$MC/master.log" 2>/dev/null || echo 0)
  start holder "$MCBIN/mooncake_client" --host=127.0.0.1 --port="$HPORT" --global_segment_size="$SEG" \
    --local_buffer_size=268435456 --master_server_address="127.0.0.1:$PORT" \
    --metadata_server=P2PHANDSHAKE --protocol=tcp
  # ready once the master logs the mount (its capacity gauge follows a few seconds later)
  cap=0
  for ((i = 0; i < WAIT * 20; i++)); do
    if tail -n +"$((mark + 1))" "$MC/master.log" 2>/dev/null | grep -q 'action=mount_segment'; then cap=mounted; break; fi
    alive holder || break
    sleep 0.05
  done
  [ "$cap" = mounted ] && { c=$(capacity); [ "${c:-0}" -gt 0 ] && cap=$c; }
  [ "$cap" = mounted ] && cap=$SEG
  if [ "$cap" = 0 ]; then
    echo "[mc_up] HOLDER NOT REGISTERED after $(secs) (alive: $(alive holder && echo yes || echo no))"
    tail -20 "$MC/holder.log"; exit 1
  fi
  echo "[mc_up] holder pid $(cat "$MC/holder.pid") mounted its segment ($cap bytes) on the master after $(secs)"
fi
echo "[mc_up] config $MC/config.json: $(cat "$MC/config.json")"
