# shellcheck shell=bash
# `scripts/epf demo`, sourced by scripts/epf (which sets ROOT, BUILD_DIR, log and cmd_build).
# The demo: a fabric of one daemon per GPU (4 host-backend daemons without GPUs; on a one-GPU machine 2 daemons that
# share it, both --device=0, so that the ranks really exchange data), a normal and a low-latency group,
# one epfabric_worker process per rank running checked dispatch + combine rounds, a table, and `demo: OK`.
# Everything it starts is stopped (SIGTERM to the daemons) and removed on every exit path. EPF_DEMO_WORKER_FLAGS adds
# flags to every worker (e.g. --flip_one_output, to see a failing run).
DEMO_PIDS=()
DEMO_INTER_PIDS=()
DEMO_WORKER_PIDS=()
DEMO_SOCK=d

demo_cleanup() {
  local rc=$?
  set +e
  for pid in "${DEMO_WORKER_PIDS[@]}"; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${DEMO_PIDS[@]}" "${DEMO_INTER_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${DEMO_PIDS[@]}" "${DEMO_INTER_PIDS[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  [[ -n ${DEMO_DIR:-} ]] && rm -rf "$DEMO_DIR"
  [[ -n ${DEMO_FABRIC:-} ]] && rm -f /dev/shm/epf."$DEMO_FABRIC".* /dev/shm/*"$DEMO_FABRIC"* 2>/dev/null
  exit "$rc"
}

# Number of GPUs CUDA can see (0 when none or no driver).
demo_gpu_count() {
  command -v nvidia-smi >/dev/null 2>&1 || { echo 0; return; }
  local n
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  if [[ -n ${CUDA_VISIBLE_DEVICES+x} ]]; then
    local visible
    visible=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true)
    ((visible < n)) && n=$visible
  fi
  echo "${n:-0}"
}

# Runs one epfabric_worker per rank of group $1 (token $2) with the scenario flags in "${@:3}"; their result lines
# go to $DEMO_DIR/results; returns non-zero when any worker failed.
demo_run_workers() {
  local group=$1 token=$2
  shift 2
  local rc=0 pid
  DEMO_WORKER_PIDS=()
  # EPF_DEMO_WORKER_FLAGS: more worker flags, separated by spaces.
  local extra_flags=()
  read -r -a extra_flags <<<"${EPF_DEMO_WORKER_FLAGS:-}"
  for ((r = 0; r < DEMO_RANKS; r++)); do
    "$DEMO_WORKER" --socket="$DEMO_DIR/$DEMO_SOCK$r.sock" --group="$group" --rank="$r" --launch_unix_ns="$(date +%s%N)" \
      --token="$token" "${DEMO_DEVICE_FLAGS[@]/\{device\}/$((r % DEMO_GPUS))}" "$@" "${extra_flags[@]}" \
      >"$DEMO_DIR/w$r.out" 2>"$DEMO_DIR/w$r.err" &
    DEMO_WORKER_PIDS+=($!)
  done
  for pid in "${DEMO_WORKER_PIDS[@]}"; do wait "$pid" || rc=1; done
  DEMO_WORKER_PIDS=()
  for ((r = 0; r < DEMO_RANKS; r++)); do
    grep -h '^EPF_RESULT' "$DEMO_DIR/w$r.out" >>"$DEMO_DIR/results" || rc=1
    if ! grep -q '^EPF_RESULT.* ok=1' "$DEMO_DIR/w$r.out"; then
      log "worker rank $r of group $group failed:"
      cat "$DEMO_DIR/w$r.out" "$DEMO_DIR/w$r.err" >&2
      rc=1
    fi
  done
  return "$rc"
}

# The restart cost without the checked worker's harness: one `epfabric_worker --restart_probe` per rank of group $1
# (token $2, scenario "${@:3}"), all started at once as fresh processes against the running daemons. Prints the
# slowest rank's EPF_RESTART line; returns non-zero when a probe failed.
demo_restart_probe() {
  local group=$1 token=$2
  shift 2
  local rc=0 r
  DEMO_WORKER_PIDS=()
  for ((r = 0; r < DEMO_RANKS; r++)); do
    "$DEMO_WORKER" --restart_probe --launch_unix_ns="$(date +%s%N)" --socket="$DEMO_DIR/d$r.sock" --group="$group" \
      --rank="$r" --token="$token" "${DEMO_DEVICE_FLAGS[@]/\{device\}/$((r % DEMO_GPUS))}" "$@" \
      >"$DEMO_DIR/p$r.out" 2>"$DEMO_DIR/p$r.err" &
    DEMO_WORKER_PIDS+=($!)
  done
  for r in "${!DEMO_WORKER_PIDS[@]}"; do wait "${DEMO_WORKER_PIDS[$r]}" || rc=1; done
  DEMO_WORKER_PIDS=()
  for ((r = 0; r < DEMO_RANKS; r++)); do
    if ! grep -q '^EPF_RESTART .* ok=1' "$DEMO_DIR/p$r.out"; then
      log "restart probe rank $r of group $group failed:"
      cat "$DEMO_DIR/p$r.out" "$DEMO_DIR/p$r.err" >&2
      rc=1
    fi
  done
  ((rc == 0)) || return 1
  awk '/^EPF_RESTART / { for (i = 2; i <= NF; i++) { split($i, kv, "=")
         if (kv[1] == "restart_to_first_dispatch_ms" && kv[2] + 0 > m) { m = kv[2] + 0; line = $0 } } }
       END { print line }' "$DEMO_DIR"/p*.out
}

# Four daemons ($1 epfabricd, $2 epctl, backend $3) acting as 2 hosts x 2 ranks (--host_id), their own fabric, the
# transport's socket wire: sockets $DEMO_DIR/i0..3.sock. Returns non-zero when they do not all come up.
demo_start_internode() {
  local daemon_bin=$1 epctl_bin=$2 backend=$3 coordinator="" r up=0
  for ((r = 0; r < 4; r++)); do
    local flags=(--rank="$r" --world_size=4 --fabric_id="${DEMO_FABRIC}x" --backend="$backend" --host_id="host-$((r / 2))"
                 --transport=socket --client_socket="$DEMO_DIR/i$r.sock" --peer_listen=127.0.0.1:0 --log_level=warn
                 --fabric_secret_file="$DEMO_DIR/fabric.secret")
    ((${#DEMO_DEVICE_FLAGS[@]})) && flags+=(--device="$((r % DEMO_GPUS))")
    ((r > 0)) && flags+=(--coordinator="$coordinator")
    "$daemon_bin" "${flags[@]}" 2>"$DEMO_DIR/i$r.log" &
    DEMO_INTER_PIDS+=($!)
    for _ in $(seq 200); do [[ -S $DEMO_DIR/i$r.sock ]] && break; sleep 0.05; done
    [[ -S $DEMO_DIR/i$r.sock ]] || { log "internode daemon $r did not start:"; cat "$DEMO_DIR/i$r.log" >&2; return 1; }
    if ((r == 0)); then
      coordinator=$("$epctl_bin" --socket="$DEMO_DIR/i0.sock" topology --json |
                    grep -o '"peer_address": *"[^"]*"' | head -1 | sed 's/.*"\([^"]*\)"$/\1/')
    fi
  done
  for _ in $(seq 200); do
    up=$("$epctl_bin" --socket="$DEMO_DIR/i0.sock" fabric 2>/dev/null | grep -cE '^ +[0-9]+ +UP ' || true)
    ((up == 4)) && return 0
    sleep 0.05
  done
  log "internode fabric: only $up of 4 ranks came up"
  return 1
}

# One table row from the result lines of group $1 with x dtype $2 (the slowest rank's median times, all ranks'
# bytes); $3, when given, is shown instead of the mode.
demo_row() {
  awk -v group="$1" -v dtype="$2" -v label="${3:-}" '
    $0 ~ "group=" group " " {
      delete f
      for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
      if (f["ok"] != 1) bad++
      if ((dtype == "fp8") != (f["fp8"] == 1)) next
      mode = label != "" ? label : f["mode"]; tokens = f["tokens"]; hidden = f["hidden"]; topk = f["topk"]; experts = f["experts"]
      if (f["dispatch_ms"] > d) d = f["dispatch_ms"]
      if (f["combine_ms"] > c) c = f["combine_ms"]
      bytes += f["bytes"]; ranks++
    }
    END {
      if (ranks == 0) exit 1
      printf "%-12s %-5s %6d %7d %5d %7d %11.2f %10.2f %12.1f  %s\n", mode, dtype, tokens, hidden, topk, experts, d,
             c, bytes / 1e6, bad ? "MISMATCH" : "ok"
      if (bad) exit 1
    }' "$DEMO_DIR/results"
}

cmd_demo() {
  # EPF_DEMO_BIN_DIR: run prebuilt epfabricd, epctl and epfabric_worker from there (a bundle on a GPU machine,
  # with LD_LIBRARY_PATH set) instead of building.
  local daemon_bin worker epctl_bin
  if [[ -n ${EPF_DEMO_BIN_DIR:-} ]]; then
    daemon_bin=$EPF_DEMO_BIN_DIR/epfabricd worker=$EPF_DEMO_BIN_DIR/epfabric_worker epctl_bin=$EPF_DEMO_BIN_DIR/epctl
  else
    cmd_build
    daemon_bin=$BUILD_DIR/daemon/epfabricd worker=$BUILD_DIR/tools/epfabric_worker epctl_bin=$BUILD_DIR/client/epctl
  fi
  for bin in "$daemon_bin" "$worker" "$epctl_bin"; do [[ -x $bin ]] || { log "missing $bin"; exit 1; }; done
  DEMO_WORKER=$worker
  # Globals, not locals: the EXIT trap runs after this function has returned.
  DEMO_DIR=$(mktemp -d /tmp/epf-demo.XXXXXX)
  DEMO_FABRIC=epfdemo$$
  trap demo_cleanup EXIT
  trap 'exit 130' INT TERM
  local gpus backend
  gpus=$(demo_gpu_count)
  # Rank r on GPU r mod $DEMO_GPUS: one GPU gives 2 ranks sharing it (a world of one would exchange nothing).
  if ((gpus > 0)); then
    DEMO_RANKS=$((gpus > 8 ? 8 : gpus < 2 ? 2 : gpus))
    DEMO_GPUS=$((gpus < DEMO_RANKS ? gpus : DEMO_RANKS))
    backend=auto
  else
    DEMO_RANKS=4
    DEMO_GPUS=1
    backend=host
  fi
  DEMO_DEVICE_FLAGS=()
  ((gpus > 0)) && DEMO_DEVICE_FLAGS=("--device={device}")
  local start=$SECONDS coordinator="" r
  # The daemons prove fabric membership to each other with a secret only this user can read (docs/security.md).
  (umask 077 && head -c 32 /dev/urandom | base64 >"$DEMO_DIR/fabric.secret")
  for ((r = 0; r < DEMO_RANKS; r++)); do
    local flags=(--rank="$r" --world_size="$DEMO_RANKS" --fabric_id="$DEMO_FABRIC" --backend="$backend"
                 --client_socket="$DEMO_DIR/d$r.sock" --peer_listen=127.0.0.1:0 --log_level=warn
                 --fabric_secret_file="$DEMO_DIR/fabric.secret" --metrics_listen=127.0.0.1:0)
    ((gpus > 0)) && flags+=(--device="$((r % DEMO_GPUS))")
    ((r > 0)) && flags+=(--coordinator="$coordinator")
    "$daemon_bin" "${flags[@]}" 2>"$DEMO_DIR/d$r.log" &
    DEMO_PIDS+=($!)
    for _ in $(seq 200); do [[ -S $DEMO_DIR/d$r.sock ]] && break; sleep 0.05; done
    [[ -S $DEMO_DIR/d$r.sock ]] || { log "daemon $r did not start:"; cat "$DEMO_DIR/d$r.log" >&2; exit 1; }
    if ((r == 0)); then
      coordinator=$("$epctl_bin" --socket="$DEMO_DIR/d0.sock" topology --json |
                    grep -o '"peer_address": *"[^"]*"' | head -1 | sed 's/.*"\([^"]*\)"$/\1/')
      [[ -n $coordinator ]] || { log "no peer address from daemon 0"; exit 1; }
    fi
  done
  local epctl=("$epctl_bin" --socket="$DEMO_DIR/d0.sock")
  local up=0
  for _ in $(seq 200); do
    up=$("${epctl[@]}" fabric 2>/dev/null | grep -cE '^ +[0-9]+ +UP ' || true)
    ((up == DEMO_RANKS)) && break
    sleep 0.05
  done
  ((up == DEMO_RANKS)) || { log "only $up of $DEMO_RANKS ranks came up"; "${epctl[@]}" fabric >&2; exit 1; }
  local ranks
  ranks=$(seq -s, 0 $((DEMO_RANKS - 1)))
  echo "fabric '$DEMO_FABRIC': $DEMO_RANKS ranks, backend $backend ($gpus GPUs visible), up in $((SECONDS - start)) s"
  ((gpus > 0 && DEMO_RANKS > gpus)) &&
    echo "shared GPU: $DEMO_RANKS ranks on $gpus GPU(s) (rank r on GPU r mod $gpus): times are not NVLink figures"

  # Scenarios: normal mode (DeepSeek-V3-like hidden, prefill-sized batches) and low latency (decode-sized).
  local experts=$((DEMO_RANKS * 8))
  local normal=(--mode=normal --tokens=128 --fixed_tokens --hidden=7168 --topk=8 --experts="$experts" --repeats=3
                --seed=7 --timeout_ms=10000)
  local low_latency=(--mode=low_latency --tokens=32 --fixed_tokens --hidden=7168 --topk=8 --experts="$experts"
                     --repeats=3 --seed=11 --timeout_ms=10000)
  local normal_bytes ll_bytes normal_token ll_token
  normal_bytes=$("$worker" --region_bytes --ranks="$DEMO_RANKS" "${normal[@]}")
  ll_bytes=$("$worker" --region_bytes --ranks="$DEMO_RANKS" "${low_latency[@]}")
  normal_token=$("${epctl[@]}" create-group --group=demo-normal --ranks="$ranks" --nvl_bytes="$normal_bytes" |
                 awk '$1 == "token" { print $2 }')
  ll_token=$("${epctl[@]}" create-group --group=demo-ll --ranks="$ranks" --nvl_bytes="$ll_bytes" --low_latency |
             awk '$1 == "token" { print $2 }')
  [[ -n $normal_token && -n $ll_token ]] || { log "create-group failed"; exit 1; }
  echo "groups: demo-normal ($((normal_bytes >> 20)) MiB per rank), demo-ll ($((ll_bytes >> 20)) MiB per rank)"

  local failed=0
  demo_run_workers demo-normal "$normal_token" "${normal[@]}" || failed=1
  demo_run_workers demo-normal "$normal_token" "${normal[@]}" --fp8 || failed=1
  demo_run_workers demo-ll "$ll_token" "${low_latency[@]}" --fp8 || failed=1
  demo_run_workers demo-ll "$ll_token" "${low_latency[@]}" || failed=1
  local probe
  probe=$(demo_restart_probe demo-normal "$normal_token" "${normal[@]}") || failed=1

  # Across hosts (issue #12): a second fabric whose four daemons act as 2 hosts x 2 ranks; rows cross between the
  # "hosts" over the transport's socket wire, then NVLink (or shared memory) within each.
  local inter=(--mode=normal --tokens=128 --fixed_tokens --hidden=7168 --topk=8 --experts=32 --repeats=3 --seed=13
               --timeout_ms=30000 --cached)
  local inter_bytes inter_token="" saved_ranks=$DEMO_RANKS
  if demo_start_internode "$daemon_bin" "$epctl_bin" "$backend"; then
    inter_bytes=$("$worker" --region_bytes --ranks=2 --hosts=2 "${inter[@]}")
    inter_token=$("$epctl_bin" --socket="$DEMO_DIR/i0.sock" create-group --group=demo-internode --ranks=0,1,2,3 \
                  --nvl_bytes="${inter_bytes% *}" --rdma_bytes="${inter_bytes#* }" | awk '$1 == "token" { print $2 }')
  fi
  if [[ -n $inter_token ]]; then
    echo "group: demo-internode (2 hosts x 2 ranks; $((${inter_bytes% *} >> 20)) MiB NVL + $((${inter_bytes#* } >> 20)) MiB RDMA per rank)"
    DEMO_SOCK=i DEMO_RANKS=4
    demo_run_workers demo-internode "$inter_token" "${inter[@]}" || failed=1
    demo_run_workers demo-internode "$inter_token" "${inter[@]}" --fp8 || failed=1
    # Worst-case mode across hosts (num_worst_tokens: the RDMA stage's rows at fixed places; on cuda its puts and waits
    # run on the device, so a prefill step can be captured into a CUDA graph; decision 88).
    local worst_token
    worst_token=$("$epctl_bin" --socket="$DEMO_DIR/i0.sock" create-group --group=demo-internode-worst \
                  --ranks=0,1,2,3 --nvl_bytes="${inter_bytes% *}" --rdma_bytes="${inter_bytes#* }" |
                  awk '$1 == "token" { print $2 }')
    if [[ -n $worst_token ]]; then
      demo_run_workers demo-internode-worst "$worst_token" "${inter[@]}" --worst_tokens=512 || failed=1
    else
      log "internode worst-case group: not created"
      failed=1
    fi
    # Low latency across hosts (cuda: relayed by each rank's calling thread, docs/internode-dispatch.md).
    local inter_ll=(--mode=low_latency --tokens=32 --fixed_tokens --hidden=7168 --topk=8 --experts=32 --repeats=3
                    --seed=17 --timeout_ms=30000)
    local ll_inter_bytes ll_inter_token
    ll_inter_bytes=$("$worker" --region_bytes --ranks=2 --hosts=2 "${inter_ll[@]}")
    ll_inter_token=$("$epctl_bin" --socket="$DEMO_DIR/i0.sock" create-group --group=demo-internode-ll \
                     --ranks=0,1,2,3 --nvl_bytes="${ll_inter_bytes% *}" --rdma_bytes="${ll_inter_bytes#* }" \
                     --low_latency | awk '$1 == "token" { print $2 }')
    if [[ -n $ll_inter_token ]]; then
      demo_run_workers demo-internode-ll "$ll_inter_token" "${inter_ll[@]}" --fp8 || failed=1
    else
      log "internode low-latency group: not created"
      failed=1
    fi
    DEMO_SOCK=d DEMO_RANKS=$saved_ranks
  else
    log "internode group: not created"
    failed=1
  fi

  echo
  printf '%-12s %-5s %6s %7s %5s %7s %11s %10s %12s  %s\n' mode x tokens hidden top-k experts dispatch_ms \
    combine_ms "bytes (MB)" check
  demo_row demo-normal bf16 || failed=1
  demo_row demo-normal fp8 || failed=1
  demo_row demo-ll fp8 || failed=1
  demo_row demo-ll bf16 || failed=1
  demo_row demo-internode bf16 "internode" || failed=1
  demo_row demo-internode fp8 "internode" || failed=1
  demo_row demo-internode-worst bf16 "internode-w" || failed=1
  demo_row demo-internode-ll fp8 "internode-ll" || failed=1
  echo "(tokens: per rank; times: median of 3 rounds, slowest rank; bytes: payload sent by all ranks in one"
  echo " dispatch + combine; every output compared element by element with the host reference and the weighted sum;"
  echo " internode-w: worst-case mode across hosts, num_worst_tokens = 512, its combine input padded to 512 rows)"
  # Fresh client processes against running daemons: from launch to the first completed dispatch (connect, attach,
  # map every peer's region, layout + dispatch), slowest rank of the first worker set.
  awk '/group=demo-normal / && / fp8=0 / { for (i = 2; i <= NF; i++) { split($i, kv, "=");
         if (kv[1] == "restart_to_first_dispatch_ms" && kv[2] > m) m = kv[2] } }
       END { if (m > 0) printf "restart to first dispatch (fresh worker processes, slowest rank; includes generating the test inputs and host reference of all ranks): %.1f ms\n", m }' \
    "$DEMO_DIR/results"
  # The same path with nothing else in it (epfabric_worker --restart_probe; docs/client.md, Restart cost).
  [[ -n $probe ]] && awk '{ for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] } }
    END {
      printf "restart to first dispatch (--restart_probe: fresh processes, slowest rank; process start, connect, "
      printf "attach + map every rank\047s region, Buffer::Create, its own inputs, layout + dispatch complete): "
      printf "%.1f ms (ms since launch: main %.1f, connected %.1f, attached %.1f, buffer %.1f, inputs %.1f)\n",
             f["restart_to_first_dispatch_ms"], f["main_ms"], f["connect_ms"], f["attach_ms"], f["buffer_ms"],
             f["inputs_ms"]
    }' <<<"$probe"

  # What Prometheus would see: a scrape of rank 0's /metrics after the rounds (docs/operations.md). The whole text
  # goes to $EPF_DEMO_METRICS_OUT when that is set.
  local metrics_address metrics_port scrape=""
  metrics_address=$("${epctl[@]}" topology --json | grep -o '"metrics_address": *"[^"]*"' | head -1 |
                    sed 's/.*"\([^"]*\)"$/\1/')
  metrics_port=${metrics_address##*:}
  if [[ -n $metrics_port ]] && exec 3<>"/dev/tcp/127.0.0.1/$metrics_port"; then
    printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    scrape=$(cat <&3)
    exec 3<&-
  fi
  if [[ $scrape == *"epfabric_"* ]]; then
    [[ -n ${EPF_DEMO_METRICS_OUT:-} ]] && printf '%s\n' "$scrape" >"$EPF_DEMO_METRICS_OUT"
    echo "metrics (rank 0, http://$metrics_address/metrics): $(grep -c '^epfabric_' <<<"$scrape") series, e.g."
    grep -E '^epfabric_(groups|leases)\{|^epfabric_rpcs_total\{.*method="Attach"|^epfabric_datapath_(calls|tokens)_total\{.*(_dispatch|"dispatch"|sent)|^epfabric_expert_(load_imbalance|tokens_received_rank_total)\{' \
      <<<"$scrape" | grep -v ' 0$' | head -12 | sed 's/^/  /'
  else
    echo "metrics: no scrape from rank 0 (metrics address '$metrics_address')"
    failed=1
  fi

  # Stop the daemons with SIGTERM: each must exit 0 and remove its socket.
  local i rc
  for i in "${!DEMO_PIDS[@]}"; do kill -TERM "${DEMO_PIDS[$i]}"; done
  for i in "${!DEMO_PIDS[@]}"; do
    rc=0
    wait "${DEMO_PIDS[$i]}" || rc=$?
    if [[ $rc -ne 0 || -e $DEMO_DIR/d$i.sock ]]; then
      log "daemon $i exited with $rc or left its socket behind"
      failed=1
    fi
  done
  DEMO_PIDS=()
  for i in "${!DEMO_INTER_PIDS[@]}"; do kill -TERM "${DEMO_INTER_PIDS[$i]}"; done
  for i in "${!DEMO_INTER_PIDS[@]}"; do
    rc=0
    wait "${DEMO_INTER_PIDS[$i]}" || rc=$?
    ((rc == 0)) || { log "internode daemon $i exited with $rc"; failed=1; }
  done
  DEMO_INTER_PIDS=()
  if compgen -G "/dev/shm/*$DEMO_FABRIC*" >/dev/null; then
    log "shared memory left behind: $(compgen -G "/dev/shm/*$DEMO_FABRIC*" | tr '\n' ' ')"
    failed=1
  fi
  echo
  if ((failed)); then
    echo "demo: FAILED"
    exit 1
  fi
  echo "demo: OK ($((SECONDS - start)) s)"
}
