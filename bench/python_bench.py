#!/usr/bin/env python3
"""Python binding costs (issue #15), on a CUDA machine with 2 ranks (threads, one stream each) on cuda daemons:
  - warm attach to the first completed dispatch: a process whose CUDA context is up attaches and finishes its first
    low-latency (and normal) dispatch + combine; median of trials, the slower rank;
  - Python overhead per call: wall time of the Python method minus the time inside the C ABI call, per call;
  - low-latency dispatch + combine captured in a CUDA graph from Python, replay time against eager calls.
Prints a table and writes python-<UTC date>.json into --out (bench/results/ by default).
"""
import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))
os.environ.setdefault("EPF_PY_BACKEND", "cuda")
import fabric  # noqa: E402

fabric.require_torch()
import torch  # noqa: E402

import epfabric  # noqa: E402
from epfabric import _lib, buffer as buffer_mod, low_latency as ll_mod, normal as normal_mod  # noqa: E402

N = 2
M, HIDDEN, TOPK, EXPERTS = 128, 7168, 8, 288  # DeepEP's low-latency benchmark shape
GRAPH_PAIRS = 20  # (dispatch, combine) pairs captured in one graph
NORMAL_TOKENS = 4096


# The C functions the modules call directly on their hot paths (module globals), and the modules' `call`.
_DIRECT = ((normal_mod, "_GET_LAYOUT"), (normal_mod, "_DISPATCH"), (normal_mod, "_COMBINE"),
           (ll_mod, "_LL_DISPATCH"), (ll_mod, "_LL_COMBINE"))


class CTimer:
    """Wraps the C ABI entry points the modules call so that the time spent inside the C ABI is summed per thread."""

    def __init__(self):
        self.inside = {}
        self.original = _lib.call
        self.saved = [(module, name, getattr(module, name)) for module, name in _DIRECT]

    def _timed(self, fn):
        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                key = threading_id()
                self.inside[key] = self.inside.get(key, 0.0) + time.perf_counter() - t0
        return timed

    def __enter__(self):
        buffer_mod.call = normal_mod.call = ll_mod.call = self._timed(self.original)
        for module, name, fn in self.saved:
            setattr(module, name, self._timed(fn))
        return self

    def __exit__(self, *exc):
        buffer_mod.call = normal_mod.call = ll_mod.call = self.original
        for module, name, fn in self.saved:
            setattr(module, name, fn)


def threading_id():
    return threading.get_ident()


def inputs(r, tokens):
    gen = torch.Generator().manual_seed(r)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
    idx = torch.rand(tokens, EXPERTS, generator=gen).topk(TOPK, dim=1).indices.cuda()
    w = torch.rand(tokens, TOPK, generator=gen).cuda()
    return x, idx, w


def measure_overhead(b, x, idx, w, timer, iterations):
    """Median Python time per low-latency dispatch and combine outside the C ABI calls (`timer` must be active)."""
    for _ in range(10):  # warm-up
        recv, _, handle, _, _ = b.low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=False)
        b.low_latency_combine(recv, idx, w, handle)
    torch.cuda.current_stream().synchronize()
    me = threading_id()
    per_call = {"dispatch": [], "combine": []}
    for i in range(iterations):
        before = timer.inside.get(me, 0.0)
        t0 = time.perf_counter()
        recv, _, handle, _, _ = b.low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=False)
        t1 = time.perf_counter()
        mid = timer.inside.get(me, 0.0)
        b.low_latency_combine(recv, idx, w, handle)
        t2 = time.perf_counter()
        after = timer.inside.get(me, 0.0)
        per_call["dispatch"].append(((t1 - t0) - (mid - before)) * 1e6)
        per_call["combine"].append(((t2 - t1) - (after - mid)) * 1e6)
        if i % 16 == 15:
            torch.cuda.current_stream().synchronize()
    torch.cuda.current_stream().synchronize()
    return {k: statistics.median(v) for k, v in per_call.items()}


def child(rank, socket, token, iterations):
    """One rank per process (how servers run): the Python overhead per call without another rank's GIL."""
    torch.cuda.init()
    b = epfabric.Buffer.attach(socket, "bench-ll", rank, token)
    x, idx, w = inputs(rank, M)
    with CTimer() as timer:
        result = measure_overhead(b, x, idx, w, timer, iterations)
    b.destroy()
    print("EPF_CHILD " + json.dumps(result), flush=True)


def overhead_in_processes(fab, token, iterations):
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(r), "--socket", fab.sockets[r], "--token",
                               token, "--iterations", str(iterations)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(N)]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=300)
        line = [t for t in text.splitlines() if t.startswith("EPF_CHILD ")]
        if p.returncode != 0 or not line:
            raise RuntimeError(f"a child rank failed:\n{text}")
        out.append(json.loads(line[0].split(" ", 1)[1]))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child >= 0:
        return child(opts.child, opts.socket, opts.token, opts.iterations)
    if not torch.cuda.is_available():
        print("SKIPPED: python_bench needs a CUDA device")
        return
    torch.cuda.init()
    torch.ones(1, device="cuda").sum().item()  # a warm process: context and torch's kernels loaded
    results = {}
    with fabric.Fabric(N, backend="cuda") as fab:
        client = epfabric.Client(fab.sockets[0])
        ll_nvl, _ = epfabric.required_group_bytes(M, HIDDEN, TOPK, EXPERTS, True, 1, N)
        ll_token = client.create_group("bench-ll", [0, 1], ll_nvl, 0, True)
        nvl, _ = epfabric.required_group_bytes(NORMAL_TOKENS, HIDDEN, TOPK, EXPERTS, False, 1, N)
        normal_token = client.create_group("bench-normal", [0, 1], nvl, 0, False)
        data = [inputs(r, M) for r in range(N)]
        normal_data = [inputs(r, 512) for r in range(N)]

        # Warm attach -> first completed dispatch + combine.
        ll_times, normal_times = [], []
        for _ in range(opts.trials):
            def first_ll(r):
                x, idx, w = data[r]
                t0 = time.perf_counter()
                b = epfabric.Buffer.attach(fab.sockets[r], "bench-ll", r, ll_token, **fabric.attach_options(N))
                b.low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=True)
                torch.cuda.current_stream().synchronize()
                t1 = time.perf_counter()
                b.destroy()
                return (t1 - t0) * 1e3

            ll_times.append(max(fabric.run_ranks(N, first_ll)))

            def first_normal(r):
                x, idx, w = normal_data[r]
                t0 = time.perf_counter()
                b = epfabric.Buffer.attach(fab.sockets[r], "bench-normal", r, normal_token)
                per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, EXPERTS)
                b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
                torch.cuda.current_stream().synchronize()
                t1 = time.perf_counter()
                b.destroy()
                return (t1 - t0) * 1e3

            normal_times.append(max(fabric.run_ranks(N, first_normal)))
        results["warm_attach_to_first_dispatch_ms"] = statistics.median(ll_times)
        results["warm_attach_to_first_dispatch_ms_max"] = max(ll_times)
        results["warm_attach_to_first_normal_dispatch_ms"] = statistics.median(normal_times)

        # Per-call overhead and CUDA graphs on one low-latency Buffer per rank.
        bufs = fabric.run_ranks(N, lambda r: epfabric.Buffer.attach(fab.sockets[r], "bench-ll", r, ll_token,
                                                                    **fabric.attach_options(N)))

        def overhead(r):
            x, idx, w = data[r]
            return measure_overhead(bufs[r], x, idx, w, timer, opts.iterations)

        with CTimer() as timer:  # one patch for both ranks' threads, removed when both are done
            over = fabric.run_ranks(N, overhead)
        results["python_overhead_dispatch_us"] = max(o["dispatch"] for o in over)
        results["python_overhead_combine_us"] = max(o["combine"] for o in over)

        def graph_vs_eager(r):
            b = bufs[r]
            x, idx, w = data[r]
            stream = torch.cuda.current_stream()

            def step():  # the expert outputs are a fixed tensor: this times the communication only
                _, _, handle, _, _ = b.low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=True)
                return b.low_latency_combine(expert_out[r], idx, w, handle)[0]

            step()
            stream.synchronize()
            barrier.wait()
            # As low_latency_bench does: one graph of GRAPH_PAIRS back-to-back (dispatch, combine) pairs, timed per
            # pair, so that the two compare (same shape, same blocks per rank on the shared GPU).
            graph = torch.cuda.CUDAGraph()
            with capture_lock:  # one capture at a time in this process (torch synchronises the device around it)
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    for _ in range(GRAPH_PAIRS):
                        step()
            barrier.wait()
            times = {"eager": [], "graph": []}
            for kind in ("eager", "graph"):
                for _ in range(opts.iterations):
                    barrier.wait()  # both ranks start together, as the C++ benchmark's lockstep replays do
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    if kind == "graph":
                        graph.replay()
                    else:
                        step()
                    end.record(stream)
                    end.synchronize()
                    times[kind].append(start.elapsed_time(end) * 1e3 / (GRAPH_PAIRS if kind == "graph" else 1))
            return {k: statistics.median(v) for k, v in times.items()}

        barrier, capture_lock = threading.Barrier(N), threading.Lock()
        expert_out = [torch.zeros(EXPERTS // N, N * M, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(N)]
        gv = fabric.run_ranks(N, graph_vs_eager)
        results["ll_dispatch_combine_graph_us"] = max(g["graph"] for g in gv)
        results["ll_dispatch_combine_eager_python_us"] = max(g["eager"] for g in gv)
        for b in bufs:
            b.destroy()
        separate = overhead_in_processes(fab, ll_token, opts.iterations)
        results["python_overhead_dispatch_us_one_rank_per_process"] = max(o["dispatch"] for o in separate)
        results["python_overhead_combine_us_one_rank_per_process"] = max(o["combine"] for o in separate)
        client.delete_group("bench-ll", ll_token)
        client.delete_group("bench-normal", normal_token)
        client.close()

    commit = os.environ.get("EPF_COMMIT") or subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                                                            capture_output=True, text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    report = {
        "name": "python", "date": date, "commit": commit or "unknown", "device": torch.cuda.get_device_name(0),
        "num_gpus": torch.cuda.device_count(), "num_ranks": N, "shared_gpu": True,  # every rank on GPU 0 (fabric.py)
        "config": {"low_latency": {"tokens_per_rank": M, "hidden": HIDDEN, "num_topk": TOPK, "num_experts": EXPERTS},
                   "normal_first_dispatch_tokens": 512, "trials": opts.trials, "iterations": opts.iterations,
                   "graph_pairs": GRAPH_PAIRS,
                   "python": sys.version.split()[0], "torch": torch.__version__,
                   "timing": "warm attach: attach + first dispatch (+ layout in normal mode) until the stream is idle, "
                             "the slower rank, median of trials; overhead: Python method wall time minus the time "
                             "inside the C ABI call, median per call, the slower rank; python_overhead_*_us: both ranks"
                             " are threads of this process, so this includes waiting for the GIL while the other rank "
                             "runs Python; *_one_rank_per_process: each rank in its own process (how servers run); "
                             "graph: CUDA events around the replay of one graph of graph_pairs back-to-back dispatch + "
                             "combine pairs (fp8), per pair, median, the slower rank (low_latency_bench's both_us with "
                             "the ranks sharing GPU 0 is the C++ figure to compare); eager: one dispatch + combine from"
                             " Python, same events"},
        "results": results,
    }
    print(f"{'measure':45s} value")
    for key, value in results.items():
        print(f"{key:45s} {value:10.2f}")
    out = pathlib.Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"python-{date}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
