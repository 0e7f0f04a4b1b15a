# shellcheck disable=SC2034  # status is device-checks' global (this file is sourced by it)
# Sourced by device-checks (its globals: BUNDLE, OUT, SECRET_FILE, status, device_of): the internode checks
# (issue #12), kept apart by role so that device-checks stays one screen per check.

# kill_case DIR NAME HOSTS PER_HOST BOUND_MS WORKER-ARGS...: a fresh group on the daemons DIR/d<r>.sock (HOSTS x
# PER_HOST ranks); the last rank SIGKILLs itself 100 us into its third dispatch; every other rank (20 s Buffer timeout)
# must stop with UNAVAILABLE within BOUND_MS of the kill (normal: an error naming a rank, low latency: the killed rank
# masked). Prints the events and one LOSS line with the slowest survivor.
kill_case() {
  local dir=$1 name=$2 hosts=$3 per_host=$4 bound_ms=$5 bytes token wpids=() mode=() r rc ns_kill ns us worst=0
  shift 5
  local worker=$BUNDLE/bin/epfabric_worker epctl=$BUNDLE/bin/epctl victim=$((hosts * per_host - 1))
  [[ " $* " == *" --mode=low_latency "* ]] && mode=(--low_latency)
  bytes=$("$worker" --region_bytes --ranks="$per_host" --hosts="$hosts" "$@") ||
    { echo "$name: --region_bytes failed"; status=1; return; }
  local sizes=(--nvl_bytes="${bytes% *}")
  ((hosts > 1)) && sizes+=(--rdma_bytes="${bytes#* }")
  token=$("$epctl" --socket="$dir/d0.sock" create-group --group="$name" --ranks="$(seq -s, 0 "$victim")" \
    "${sizes[@]}" "${mode[@]}" | awk '/^token/{print $2}')
  [[ -n $token ]] || { echo "$name: create-group failed"; status=1; return; }
  echo "== $name: $*"
  for r in $(seq 0 "$victim"); do
    local extra=()
    ((r == victim)) && extra=(--sigkill_in_dispatch=3 --sigkill_delay_us=100)
    timeout 120 "$worker" --socket="$dir/d$r.sock" --group="$name" --rank="$r" --token="$token" \
      --device="$(device_of "$r")" --until_timeout --max_seconds=60 --timeout_ms=20000 "$@" "${extra[@]}" \
      >"$dir/$name.$r.out" 2>&1 &
    wpids+=($!)
  done
  for r in $(seq 0 "$victim"); do rc=0; wait "${wpids[$r]}" || rc=$?; echo "$name rank $r exit $rc"; done
  grep -h "EPF_EVENT" "$dir/$name".*.out
  ns_kill=$(grep -o 'sigkill unix_ns=[0-9]*' "$dir/$name.$victim.out" | grep -o '[0-9]*$')
  for r in $(seq 0 $((victim - 1))); do
    ns=$(grep -o 'timeout unix_ns=[0-9]*' "$dir/$name.$r.out" | grep -o '[0-9]*$')
    if [[ -n $ns && -n $ns_kill ]] && grep -q "timeout unix_ns=.*UNAVAILABLE" "$dir/$name.$r.out"; then
      us=$(((ns - ns_kill) / 1000))
      ((us > worst)) && worst=$us
    else
      echo "$name: rank $r: no UNAVAILABLE event after the kill"; tail -3 "$dir/$name.$r.out"; status=1
    fi
  done
  echo "LOSS $name: the last survivor stopped waiting $((worst / 1000)).$(printf %03d $((worst % 1000))) ms after the kill"
  ((worst < bound_ms * 1000)) || { echo "$name: slower than $bound_ms ms"; status=1; }
  "$epctl" --socket="$dir/d0.sock" delete-group --group="$name" --token="$token" >/dev/null || status=1
}

# run_internode [all|device|relay|wide|worst]: every case (default), only the low-latency cases issued from the device
# or relayed, (wide) two small low-latency cases, relayed and device-issued, meant for large groups (e.g.
# EPF_HOSTS=9 EPF_RANKS_PER_HOST=8: 72 daemons and workers, past the rank sets' first 64-bit word), or (worst) only
# the normal-mode cases in worst-case mode (the RDMA stage's puts and waits on the device, CUDA graphs).
run_internode() {
  local only=${1:-all}
  local dir pids=() r rc epctl=$BUNDLE/bin/epctl worker=$BUNDLE/bin/epfabric_worker
  # $EPF_HOSTS x $EPF_RANKS_PER_HOST ranks (default 2 x 2; e.g. 2 x 4 on 8 GPUs, issue #17).
  local hosts=${EPF_HOSTS:-2} per_host=${EPF_RANKS_PER_HOST:-2}
  local world=$((hosts * per_host)) ranks
  ranks=$(seq -s, 0 $((world - 1)))
  # Expert counts that the ranks divide: 16 and 32 up to 8 ranks (and 16), the next multiple of the ranks beyond.
  local e16=$(((16 + world - 1) / world * world)) e32=$(((32 + world - 1) / world * world))
  dir=$(mktemp -d /tmp/epf-in.XXXXXX)
  for ((r = 0; r < world; r++)); do
    local role=(--coordinator=127.0.0.1:7900)
    ((r == 0)) && role=(--peer_listen=127.0.0.1:7900)
    "$BUNDLE/bin/epfabricd" --fabric_secret_file="$SECRET_FILE" --client_socket="$dir/d$r.sock" --rank=$r \
      --world_size=$world --device="$(device_of $r)" --backend=cuda --host_id="host-$((r / per_host))" \
      --fabric_id=gpu-internode --transport="${EPF_TRANSPORT:-socket}" "${role[@]}" 2>"$dir/daemon$r.log" &
    pids+=($!)
    ((r == 0)) && sleep 0.5
  done
  # internode_case NAME [SANITIZE] WORKER-ARGS...: a fresh group sized for the case, one worker per rank.
  internode_case() {
    local name=$1 sanitize=$2 bytes token wpids=() mode=()
    shift 2
    [[ " $* " == *" --mode=low_latency "* ]] && mode=(--low_latency)
    if [[ " $* " == *" --mode=both "* ]]; then
      # One low-latency group that serves normal mode too: normal mode's parts first (rounded up to 4096).
      local args=("$@") normal ll
      if ! normal=$("$worker" --region_bytes --ranks="$per_host" --hosts="$hosts" "${args[@]/#--mode=both/--mode=normal}") ||
        ! ll=$("$worker" --region_bytes --ranks="$per_host" --hosts="$hosts" "${args[@]/#--mode=both/--mode=low_latency}"); then
        echo "$name: --region_bytes failed"; status=1; return
      fi
      local normal_nvl=$(((${normal% *} + 4095) / 4096 * 4096)) normal_rdma=$(((${normal#* } + 4095) / 4096 * 4096))
      mode=(--low_latency --normal_bytes="$normal_nvl" --normal_rdma_bytes="$normal_rdma")
      bytes="$((normal_nvl + ${ll% *})) $((normal_rdma + ${ll#* }))"
    else
      bytes=$("$worker" --region_bytes --ranks="$per_host" --hosts="$hosts" "$@") ||
        { echo "$name: --region_bytes failed"; status=1; return; }
    fi
    # $EPF_CHANNELS: the group's transport channels (default: the daemon's, 4).
    token=$("$epctl" --socket="$dir/d0.sock" --timeout_ms=60000 create-group --group="$name" --ranks="$ranks" "${mode[@]}" \
      --nvl_bytes="${bytes% *}" --rdma_bytes="${bytes#* }" --transport_channels="${EPF_CHANNELS:-0}" |
      awk '/^token/{print $2}')
    [[ -n $token ]] || { echo "$name: create-group failed"; status=1; return; }
    echo "== $name: $*"
    for ((r = 0; r < world; r++)); do
      local pre=()
      [[ $sanitize == memcheck && $r == 0 ]] && pre=(compute-sanitizer --tool memcheck --error-exitcode 99)
      timeout 300 "${pre[@]}" "$worker" --socket="$dir/d$r.sock" --group="$name" --rank=$r --token="$token" \
        --device="$(device_of $r)" "$@" >"$dir/$name.$r.out" 2>&1 &
      wpids+=($!)
    done
    for ((r = 0; r < world; r++)); do
      rc=0; wait "${wpids[$r]}" || rc=$?
      grep -E "EPF_RESULT|ERROR SUMMARY|Error" "$dir/$name.$r.out" | head -5
      if [[ $rc -ne 0 ]]; then
        echo "$name rank $r: exit $rc"
        # A sanitizer's first reports (what and where), which the tail below would not show.
        [[ $sanitize == memcheck && $r == 0 ]] &&
          grep -m 12 -E '^========= +(Invalid|Program hit|Address|at |by thread|Error)' "$dir/$name.$r.out"
        tail -20 "$dir/$name.$r.out"
        status=1
      fi
    done
    "$epctl" --socket="$dir/d0.sock" --timeout_ms=60000 delete-group --group="$name" --token="$token" >/dev/null || true
  }
  {
    echo "internode: $hosts hosts x $per_host ranks"
    for _ in $(seq 150); do
      "$epctl" --socket="$dir/d$((world - 1)).sock" --service=epfabric.v1.Fabric health >/dev/null 2>&1 && break
      sleep 0.1
    done
    # Every member up as rank 0 sees it (a large fabric takes a while to form), at most 120 s.
    local up=0
    for _ in $(seq 240); do
      up=$("$epctl" --socket="$dir/d0.sock" fabric 2>/dev/null | grep -cE '^  [0-9]+ +UP ')
      ((up == world)) && break
      sleep 0.5
    done
    echo "fabric: $up of $world members up"
    if [[ $only == wide ]]; then
      local wide=(--mode=low_latency --repeats=2 --timeout_ms=120000 --tokens=8 --hidden=256 --topk=8 "--experts=$e16")
      internode_case wide-relay no "${wide[@]}" --hooks --fp8 --seed=61
      internode_case wide-device no "${wide[@]}" --low_latency_issue=device --seed=62
    fi
    local common=(--mode=normal --repeats=3 --cached --timeout_ms=60000)
    if [[ $only == all || $only == relay ]]; then
    [[ $only == all ]] && {
    internode_case bf16 no "${common[@]}" --tokens=128 --hidden=1024 --topk=8 --experts=$e32 --seed=1
    internode_case fp8 no "${common[@]}" --tokens=128 --hidden=1024 --topk=8 --experts=$e32 --fp8 --seed=2
    internode_case h7168 no "${common[@]}" --tokens=64 --hidden=7168 --topk=8 --experts=$e32 --fixed_tokens --seed=3
    internode_case h7168fp8 no "${common[@]}" --tokens=64 --hidden=7168 --topk=8 --experts=$e32 --fp8 --seed=4
    internode_case ue8m0 no "${common[@]}" --tokens=64 --hidden=1024 --topk=8 --experts=$e32 --fp8 --packed_scales --seed=9
    internode_case oneexpert no "${common[@]}" --tokens=64 --hidden=512 --topk=4 --experts=$e16 --routing=one_expert --seed=5
    internode_case minusone no "${common[@]}" --tokens=64 --hidden=512 --topk=8 --experts=$e16 --empty_fraction=0.6 --seed=6
    internode_case silent no "${common[@]}" --tokens=64 --hidden=512 --topk=4 --experts=$e16 --routing=silent --silent_rank=2 --seed=7
    internode_case memcheck memcheck --mode=normal --repeats=1 --cached --timeout_ms=120000 --tokens=16 --hidden=256 \
      --topk=4 --experts=$e16 --seed=8
    }
    # Low latency across hosts: the cuda relay (odd rounds through the receive hooks); up to 256 ranks in all.
    local ll=(--mode=low_latency --repeats=4 --hooks --timeout_ms=60000)
    internode_case ll-fp8 no "${ll[@]}" --tokens=64 --hidden=1024 --topk=8 --experts=$e32 --fp8 --seed=21
    internode_case ll-bf16 no "${ll[@]}" --tokens=64 --hidden=1024 --topk=8 --experts=$e32 --empty_fraction=0.6 --seed=22
    internode_case ll-h7168 no "${ll[@]}" --tokens=32 --hidden=7168 --topk=8 --experts=$e32 --fp8 --fixed_tokens --seed=23
    internode_case ll-silent no "${ll[@]}" --tokens=32 --hidden=512 --topk=4 --experts=$e16 --routing=silent --silent_rank=2 --seed=24
    internode_case ll-oneexpert no "${ll[@]}" --tokens=32 --hidden=512 --topk=4 --experts=$e16 --routing=one_expert --seed=25
    internode_case ll-memcheck memcheck --mode=low_latency --repeats=2 --hooks --timeout_ms=120000 --tokens=16 \
      --hidden=256 --topk=4 --experts=$e16 --seed=26
    # SGLang's auto mode across hosts: a normal round, then a low-latency round, on one group's two parts.
    internode_case both no --mode=both --repeats=3 --cached --timeout_ms=60000 --tokens=64 --hidden=1024 --topk=8 \
      --experts=$e32 --fp8 --seed=29
    # A client killed mid-dispatch (issue #12's faults), both modes.
    [[ $only == all ]] && kill_case "$dir" loss-normal "$hosts" "$per_host" 2000 --mode=normal --tokens=128 --hidden=1024 --topk=4 \
      --experts=$e16 --seed=27
    kill_case "$dir" loss-ll "$hosts" "$per_host" 2000 --mode=low_latency --tokens=32 \
      --hidden=1024 --topk=4 --experts=$e16 --fp8 --seed=28
    fi
    # Low latency across hosts issued from the device (decision 84): the kernels put and wait, nothing waits on the
    # host, so the calls can be captured into CUDA graphs (the graph cases replay a captured dispatch and combine
    # every round with new inputs).
    if [[ $only == all || $only == device ]]; then
    local dev=(--mode=low_latency --low_latency_issue=device --timeout_ms=60000)
    internode_case dev-fp8 no "${dev[@]}" --repeats=4 --hooks --tokens=64 --hidden=1024 --topk=8 --experts=$e32 --fp8 \
      --seed=41
    internode_case dev-bf16 no "${dev[@]}" --repeats=4 --hooks --tokens=64 --hidden=1024 --topk=8 --experts=$e32 \
      --empty_fraction=0.6 --seed=42
    internode_case dev-silent no "${dev[@]}" --repeats=4 --tokens=32 --hidden=512 --topk=4 --experts=$e16 \
      --routing=silent --silent_rank=2 --seed=44
    internode_case dev-graph no "${dev[@]}" --repeats=6 --graph --tokens=32 --hidden=1024 --topk=8 --experts=$e32 \
      --fp8 --fixed_tokens --seed=45
    internode_case dev-graph-h7168 no "${dev[@]}" --repeats=4 --graph --tokens=32 --hidden=7168 --topk=8 \
      --experts=$e32 --fp8 --fixed_tokens --seed=46
    internode_case dev-memcheck memcheck --mode=low_latency --low_latency_issue=device --repeats=2 --timeout_ms=120000 \
      --tokens=16 --hidden=256 --topk=4 --experts=$e16 --seed=47
    internode_case dev-both no --mode=both --low_latency_issue=device --repeats=3 --cached --timeout_ms=60000 \
      --tokens=64 --hidden=1024 --topk=8 --experts=$e32 --fp8 --seed=48
    kill_case "$dir" loss-ll-dev "$hosts" "$per_host" 2000 --mode=low_latency --low_latency_issue=device \
      --tokens=32 --hidden=1024 --topk=4 --experts=$e16 --fp8 --seed=49
    fi
    # Normal mode in worst-case mode (num_worst_tokens = the most a rank can receive): the RDMA stage's plan, puts,
    # waits and gather on the device; the graph cases replay a captured layout + dispatch and combine every round.
    if [[ $only == all || $only == worst ]]; then
    local worst=(--mode=normal --timeout_ms=60000)
    internode_case worst-bf16 no "${worst[@]}" --repeats=3 --cached --tokens=128 --hidden=1024 --topk=8 \
      --experts=$e32 --worst_tokens=$((world * 128)) --seed=81
    internode_case worst-ue8m0 no "${worst[@]}" --repeats=3 --cached --tokens=64 --hidden=1024 --topk=8 \
      --experts=$e32 --fp8 --packed_scales --empty_fraction=0.5 --worst_tokens=$((world * 64)) --seed=82
    internode_case worst-silent no "${worst[@]}" --repeats=3 --cached --tokens=64 --hidden=512 --topk=4 \
      --experts=$e16 --routing=silent --silent_rank=2 --worst_tokens=$((world * 64)) --seed=83
    internode_case worst-graph no "${worst[@]}" --repeats=6 --graph --fixed_tokens --tokens=64 --hidden=1024 \
      --topk=8 --experts=$e32 --fp8 --worst_tokens=$((world * 64)) --seed=84
    internode_case worst-graph-h7168 no "${worst[@]}" --repeats=4 --graph --fixed_tokens --tokens=32 --hidden=7168 \
      --topk=8 --experts=$e32 --worst_tokens=$((world * 32)) --seed=85
    internode_case worst-memcheck memcheck --mode=normal --repeats=2 --cached --timeout_ms=120000 --tokens=16 \
      --hidden=256 --topk=4 --experts=$e16 --worst_tokens=$((world * 16)) --seed=86
    kill_case "$dir" loss-normal-worst "$hosts" "$per_host" 2000 --mode=normal --tokens=128 --hidden=1024 --topk=4 \
      --experts=$e16 --worst_tokens=$((world * 128)) --seed=87
    fi
  } 2>&1 | tee "$OUT/internode.txt"
  # all: 9 normal + 6 low-latency (relay) + 1 both + 7 device-issued + 6 worst-case cases; one memcheck case per mode
  # and per issuer.
  local cases=29 memchecks=4
  [[ $only == device ]] && cases=7 memchecks=1
  [[ $only == relay ]] && cases=7 memchecks=1  # 6 relayed low-latency cases + both
  [[ $only == wide ]] && cases=2 memchecks=0
  [[ $only == worst ]] && cases=6 memchecks=1
  [[ $(grep -c " ok=1 " "$OUT/internode.txt") -ge $((cases * world)) ]] ||
    { echo "internode: not every worker passed"; status=1; }
  [[ $(grep -c "ERROR SUMMARY: 0 errors" "$OUT/internode.txt") -ge $memchecks ]] ||
    { echo "internode: no clean memcheck summary"; status=1; }
  for pid in "${pids[@]}"; do kill -TERM "$pid"; done
  for pid in "${pids[@]}"; do rc=0; wait "$pid" || rc=$?; [[ $rc -eq 0 ]] || status=1; done
  grep -h -i "error\|warn\|terminate\|what()" "$dir"/daemon*.log | head -20 >>"$OUT/internode.txt"
  rm -rf "$dir"
}
