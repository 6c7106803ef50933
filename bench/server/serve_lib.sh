# bench/server/serve_lib.sh — sourced by the server benches that start `tessera serve` themselves (gpu_load.sh,
# itl_load.sh): $pid is the server's process; stop_server ends it (TERM, up to 10 s, then KILL) and is the EXIT trap.
pid=""
stop_server() {
  [ -n "$pid" ] || return 0
  kill "$pid" 2> /dev/null
  for _ in $(seq 50); do kill -0 "$pid" 2> /dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2> /dev/null
  wait "$pid" 2> /dev/null
  pid=""
}
trap stop_server EXIT
