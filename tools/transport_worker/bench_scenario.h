// The transport benchmark's worker side (--scenario=bench; bench/transport_bench.cc starts one per rank of a group of
// 2 ranks on daemons acting as separate hosts). Rank 0 measures, rank 1 answers the ping-pong and otherwise waits;
// the ranks meet at barriers (signals into each other's region). Rank 0 prints one `EPF_BENCH key=value` line per
// figure, `EPF_BENCH_INFO` lines (text), then `EPF_RESULT ok=1`. Phases:
//   1. pickup latency: one 8-byte put to itself on ring 0, host-issued, timed from before the publish until
//      RingControl::consumed passes it (then a quiet, untimed); `idle` samples sleep --bench_idle_gap_us between
//      commands (the proxy has backed off to sleeping), `warm` samples follow each other at once;
//   2. signal round trip: rank 0 signal_adds rank 1's ping word, rank 1 answers on rank 0's pong word; each spins on
//      its own region's word. Host-issued;
//   3. put bandwidth to rank 1 for each of --bench_sizes: puts + quiet on ring 0, then on every ring at once (a thread
//      each), --bench_reps repetitions of about --bench_bytes_per_rep bytes; issued from the host or, with
//      --issue_from=device, from a CUDA kernel (Issuers). The daemons' CPU use (/proc/<pid>/stat of
//      --bench_daemon_pids) is read around the single-ring and the all-rings parts.
#pragma once

namespace epfabric::tools {

// Runs the whole scenario (connects, attaches, measures); or prints the RDMA region size it needs with
// --print_region_bytes (--channels, --bench_max_bytes). Returns the process exit code.
int BenchMain();

}  // namespace epfabric::tools
