#!/usr/bin/env python3
"""Python per-call overhead on the host backend (issue #15), runnable on a CPU-only machine: one daemon, a one-rank
group (nothing waits on a peer), small shapes (the library's own work is small). For each call it prints, as the
median over --iterations calls:
  python  the Python method's wall time (epfabric.Buffer.dispatch, combine, low_latency_dispatch, ...);
  c_abi   the same call made directly through the C ABI with argument structs built once and the library's own
          allocator (what a C++ caller pays);
  over    python - c_abi: what the Python layer adds (argument checks, descriptors, allocator callbacks, wrapping
          outputs, handles).
Usage: bench/python_overhead_cpu.py [--iterations N] [--json FILE]  (EPF_BUILD_DIR selects the build; default build/)
"""
import argparse
import ctypes
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))
os.environ["EPF_PY_BACKEND"] = "host"
import fabric  # noqa: E402

fabric.require_torch()
import torch  # noqa: E402

import epfabric  # noqa: E402
from epfabric import _lib  # noqa: E402
from epfabric._tensors import describe  # noqa: E402

M, HIDDEN, TOPK, EXPERTS = 16, 512, 8, 8  # low latency: max tokens per rank; normal mode uses M tokens too


def median_us(fn, iterations):
    for _ in range(min(200, iterations)):  # warm-up
        fn()
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def Buffer_num_sms(b):
    return epfabric.Buffer.num_sms if b._num_sms is None else b._num_sms


def raw_buffer(b, config):
    """A C Buffer on the Python Buffer's lease with the library's own allocator (no Python callbacks)."""
    cbuf = ctypes.c_void_p()
    _lib.call("epf_buffer_create", b._lease, ctypes.byref(config), _lib.ALLOC_FN(), _lib.FREE_FN(), None,
              ctypes.byref(cbuf))
    return cbuf


def ll_case(client, sock, iterations):
    nvl, rdma = epfabric.required_group_bytes(M, HIDDEN, TOPK, EXPERTS, True, 1, 1)
    token = client.create_group("ovh-ll", [0], nvl, rdma, True)
    b = epfabric.Buffer.attach(sock, "ovh-ll", 0, token)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M, HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.rand(M, EXPERTS, generator=gen).topk(TOPK, dim=1).indices
    w = torch.rand(M, TOPK, generator=gen)
    state = {}

    def py_dispatch():
        state["d"] = b.low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=False)

    def py_combine():
        recv, _, handle, _, _ = state["d"]
        b.low_latency_combine(recv, idx, w, handle)

    def py_pair():
        py_dispatch()
        py_combine()

    py_pair()  # creates the Buffer
    out = {}
    out["ll_pair_python_us"] = median_us(py_pair, iterations)
    # Dispatch and combine separately: each timed call is followed by its untimed partner (the halves alternate).
    times_d, times_c = [], []
    for i in range(iterations + 100):
        t0 = time.perf_counter()
        py_dispatch()
        t1 = time.perf_counter()
        py_combine()
        t2 = time.perf_counter()
        if i >= 100:
            times_d.append(t1 - t0)
            times_c.append(t2 - t1)
    out["ll_dispatch_python_us"] = statistics.median(times_d) * 1e6
    out["ll_combine_python_us"] = statistics.median(times_c) * 1e6

    config = _lib.BufferConfig(M, HIDDEN, TOPK, EXPERTS, 1, 1, 5.0, 0)
    cbuf = raw_buffer(b, config)
    dargs = _lib.LLDispatchArgs()
    dargs.x = describe(x, "x", (torch.bfloat16,), 2, b.device)
    dargs.topk_idx = describe(idx, "topk_idx", (torch.int64,), 2, b.device)
    dres = _lib.LLDispatchResult()
    # The outputs are the library's blocks, freed when the call returns (its allocator's free): the combine takes
    # expert outputs of the right shape made once.
    expert_out = torch.randn(EXPERTS, M, HIDDEN, generator=gen).to(torch.bfloat16)
    cargs = _lib.LLCombineArgs()
    cargs.x = describe(expert_out, "x", (torch.bfloat16,), 3, b.device)
    cargs.topk_idx = dargs.topk_idx
    cargs.topk_weights = describe(w, "topk_weights", (torch.float32,), 2, b.device)
    cres = _lib.LLCombineResult()
    lib = _lib.lib
    times_d, times_c = [], []
    for i in range(iterations + 100):
        t0 = time.perf_counter()
        lib.epf_low_latency_dispatch(cbuf, ctypes.byref(dargs), None, ctypes.byref(dres))
        t1 = time.perf_counter()
        cargs.handle = dres.handle
        lib.epf_low_latency_combine(cbuf, ctypes.byref(cargs), None, ctypes.byref(cres))
        t2 = time.perf_counter()
        lib.epf_ll_handle_destroy(dres.handle)
        if i >= 100:
            times_d.append(t1 - t0)
            times_c.append(t2 - t1)
    out["ll_dispatch_c_abi_us"] = statistics.median(times_d) * 1e6
    out["ll_combine_c_abi_us"] = statistics.median(times_c) * 1e6
    lib.epf_buffer_destroy(cbuf)
    b.destroy()
    client.delete_group("ovh-ll", token)
    return out


def normal_case(client, sock, iterations):
    nvl, rdma = epfabric.required_group_bytes(M, HIDDEN, TOPK, EXPERTS, False, 1, 1)
    token = client.create_group("ovh-normal", [0], nvl, rdma, False)
    b = epfabric.Buffer.attach(sock, "ovh-normal", 0, token)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(M, HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.rand(M, EXPERTS, generator=gen).topk(TOPK, dim=1).indices
    w = torch.rand(M, TOPK, generator=gen)
    per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    state = {}

    def py_dispatch():
        state["d"] = b.dispatch(x, **layout, topk_idx=idx, topk_weights=w)

    def py_combine():
        recv_x, _, recv_w, _, handle, _ = state["d"]
        b.combine(recv_x, handle, topk_weights=recv_w)

    py_dispatch()
    py_combine()
    out = {}
    out["layout_python_us"] = median_us(lambda: b.get_dispatch_layout(idx, EXPERTS), iterations)
    out["dispatch_python_us"] = median_us(py_dispatch, iterations)
    out["combine_python_us"] = median_us(py_combine, iterations)

    # The Python Buffer's sizes (max tokens = what the region holds).
    from epfabric.buffer import _config, _max_tokens
    config = _config(1, HIDDEN, TOPK, EXPERTS, Buffer_num_sms(b), False, 5.0)
    config.max_tokens_per_rank = _max_tokens(config, 1, 1, b.num_nvl_bytes, b.num_rdma_bytes)
    cbuf = raw_buffer(b, config)
    lay = _lib.Layout()
    lay.num_tokens_per_rank = describe(per_rank, "a", (torch.int32,), 1, b.device)
    lay.num_tokens_per_expert = describe(per_expert, "b", (torch.int32,), 1, b.device)
    lay.is_token_in_rank = describe(in_rank, "c", (torch.bool,), 2, b.device)
    dargs = _lib.DispatchArgs()
    dargs.x = describe(x, "x", (torch.bfloat16,), 2, b.device)
    dargs.topk_idx = describe(idx, "topk_idx", (torch.int64,), 2, b.device)
    dargs.topk_weights = describe(w, "topk_weights", (torch.float32,), 2, b.device)
    dargs.layout = ctypes.pointer(lay)
    dres = _lib.DispatchResult()
    recv_x, _, recv_w, _, _, _ = state["d"]  # combine inputs of the received shape, made once (see ll_case)
    combine_x, combine_w = recv_x.clone(), recv_w.clone()
    cargs = _lib.CombineArgs()
    cargs.x = describe(combine_x, "x", (torch.bfloat16,), 2, b.device)
    cargs.topk_weights = describe(combine_w, "w", (torch.float32,), 2, b.device)
    cres = _lib.CombineResult()
    lib = _lib.lib
    times_d, times_c = [], []
    for i in range(iterations + 100):
        t0 = time.perf_counter()
        lib.epf_dispatch(cbuf, ctypes.byref(dargs), None, ctypes.byref(dres))
        t1 = time.perf_counter()
        cargs.handle = dres.handle
        lib.epf_combine(cbuf, ctypes.byref(cargs), None, ctypes.byref(cres))
        t2 = time.perf_counter()
        lib.epf_dispatch_handle_destroy(dres.handle)
        if i >= 100:
            times_d.append(t1 - t0)
            times_c.append(t2 - t1)
    out["dispatch_c_abi_us"] = statistics.median(times_d) * 1e6
    out["combine_c_abi_us"] = statistics.median(times_c) * 1e6
    lib.epf_buffer_destroy(cbuf)
    b.destroy()
    client.delete_group("ovh-normal", token)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json", default="")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    with fabric.Fabric(1, backend="host") as fab:
        client = epfabric.Client(fab.sockets[0])
        results = {}
        results.update(ll_case(client, fab.sockets[0], opts.iterations))
        results.update(normal_case(client, fab.sockets[0], opts.iterations))
        client.close()
    rows = [("low-latency dispatch", "ll_dispatch"), ("low-latency combine", "ll_combine"),
            ("normal dispatch", "dispatch"), ("normal combine", "combine")]
    print(f"{'call':24} {'python us':>10} {'c_abi us':>10} {'over us':>10}")
    for name, key in rows:
        py, c = results[f"{key}_python_us"], results[f"{key}_c_abi_us"]
        results[f"{key}_overhead_us"] = py - c
        print(f"{name:24} {py:10.1f} {c:10.1f} {py - c:10.1f}")
    print(f"{'layout (python)':24} {results['layout_python_us']:10.1f}")
    print(f"{'ll dispatch+combine (py)':24} {results['ll_pair_python_us']:10.1f}")
    commit = subprocess.run(["git", "-C", str(pathlib.Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    report = {"name": "python-overhead-cpu",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ"),
              "device": f"CPU host-backend run ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
              "commit": commit or "unknown",
              "config": {"max_tokens": M, "hidden": HIDDEN, "topk": TOPK, "experts": EXPERTS, "ranks": 1,
                         "backend": "host", "torch": torch.__version__, "python": sys.version.split()[0],
                         "iterations": opts.iterations},
              "results": results}
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
