#!/usr/bin/env bash
# On the GPU machine: start mooncake_master + MC_HOLDERS standalone holders (mooncake_client processes
# owning the pool's memory, MC_SEGMENT split evenly) on 127.0.0.1, unless they already run; write the
# client config. Logs and pids in /tmp/mc (holder.pid, holder1.pid, ...).
#   bash scripts/gpu/mc_up.sh        (after install.sh; stop with mc_down.sh)
# Both run in their own session (setsid), so they outlive this call and serve the next calls while the
# machine stays warm; mc_down.sh stops them by pid. Env knobs: MC_SEGMENT (holder's global segment,
# bytes, default 16 GiB, split over the holders), MC_HOLDERS (4), MC_MASTER_PORT (50051),
# MC_METRICS_PORT (9003), MC_HOLDER_PORT (50100; holder i listens on +i: clear of the seed's P2P bootstrap ports 50052/50053), MC_WAIT (seconds, 30).
# MC_METADATA=etcd (issue 25, the seed's legacy recipe): an etcd server (ETCD_BIN, default `etcd` on
# PATH) on 127.0.0.1:MC_ETCD_PORT (2379) is the metadata server of the holders and of both configs,
# and two more configs are written: seed.json = the seed's v0/mooncake-tcp.json as written (its
# keys, loopback addresses) and seed-client.json = the same + "global_segment_size": "0" (a pure
# client, so what it saves lives in the holders and outlives it).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/env.sh"
MC=${MC_DIR:-${GPU_PREFIX:-/tmp}/mc}
SEG=${MC_SEGMENT:-17179869184}
PORT=${MC_MASTER_PORT:-50051} METRICS=${MC_METRICS_PORT:-9003} HPORT=${MC_HOLDER_PORT:-50100}
WAIT=${MC_WAIT:-30}
HOLDERS=${MC_HOLDERS:-4}
METADATA=${MC_METADATA:-P2PHANDSHAKE}
ETCD_PORT=${MC_ETCD_PORT:-2379}
[ "$METADATA" = etcd ] && METADATA=etcd://127.0.0.1:$ETCD_PORT
mkdir -p "$MC"
t0=${EPOCHREALTIME/./}
secs() { local us=$(( ${EPOCHREALTIME/./} - t0 )); printf "%d.%02ds" $((us / 1000000)) $(((us / 10000) % 100)); }
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
{"metadata_server":"$METADATA","global_segment_size":"0","local_buffer_size":"1GB","protocol":"tcp","device_name":"","master_server_address":"127.0.0.1:$PORT","mode":"standalone-store"}
JSON

if [ "${METADATA#etcd://}" != "$METADATA" ]; then
  cat > "$MC/seed.json" <<JSON
{
  "local_hostname": "127.0.0.1",
  "metadata_server": "$METADATA",
  "protocol": "tcp",
  "device_name": "",
  "master_server_address": "127.0.0.1:$PORT"
}
JSON
  sed 's/"master_server_address"/"global_segment_size": "0",\n  "master_server_address"/' \
    "$MC/seed.json" > "$MC/seed-client.json"
  if alive etcd; then
    echo "[mc_up] etcd already running (pid $(cat "$MC/etcd.pid"))"
  else
    rm -rf "$MC/etcd.pid" "$MC/etcd-data"
    start etcd "${ETCD_BIN:-etcd}" --data-dir "$MC/etcd-data" --name mc \
      --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
      --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
      --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
      --initial-cluster "mc=http://127.0.0.1:$((ETCD_PORT + 1))"
    for ((i = 0; i < WAIT * 20; i++)); do tcp_open "$ETCD_PORT" && break; alive etcd || break; sleep 0.05; done
    if ! tcp_open "$ETCD_PORT"; then echo "[mc_up] ETCD NOT UP after $(secs)"; tail -20 "$MC/etcd.log"; exit 1; fi
    echo "[mc_up] etcd pid $(cat "$MC/etcd.pid") accepts on 127.0.0.1:$ETCD_PORT after $(secs)"
  fi
fi

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

mounts() { local n; n=$(grep -c 'action=mount_segment' "$MC/master.log" 2>/dev/null); echo "${n:-0}"; }
start_holder() {  # start_holder NAME PORT
  local name=$1 port=$2 mark cap=0 each=$((SEG / HOLDERS))
  if alive "$name"; then
    echo "[mc_up] $name already running (pid $(cat "$MC/$name.pid"))"; return 0
  fi
  rm -f "$MC/$name.pid"
  mark=$(mounts)
  start "$name" "$MCBIN/mooncake_client" --host=127.0.0.1 --port="$port" --global_segment_size="$each" \
    --local_buffer_size=268435456 --master_server_address="127.0.0.1:$PORT" \
    --metadata_server="$METADATA" --protocol=tcp
  # ready once the master logs one more mount
  for ((i = 0; i < WAIT * 20; i++)); do
    [ "$(mounts)" -gt "$mark" ] && { cap=$each; break; }
    alive "$name" || break
    sleep 0.05
  done
  if [ "$cap" = 0 ]; then
    echo "[mc_up] $name NOT REGISTERED after $(secs) (alive: $(alive "$name" && echo yes || echo no))"
    tail -20 "$MC/$name.log"; return 1
  fi
  echo "[mc_up] $name pid $(cat "$MC/$name.pid") mounted its segment ($each bytes) after $(secs)"
}
for ((h = 0; h < HOLDERS; h++)); do
  name=holder; [ "$h" -gt 0 ] && name=holder$h
  start_holder "$name" $((HPORT + h)) || exit 1
done
echo "[mc_up] master capacity gauge $(capacity) bytes over $HOLDERS holder(s)"
echo "[mc_up] config $MC/config.json: $(cat "$MC/config.json")"
