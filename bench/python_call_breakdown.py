#!/usr/bin/env python3
"""What the torch operations the Python binding makes per low-latency call cost on this machine (issue #15's overhead
goal): each operation timed alone, in a loop, median of rounds, in microseconds. No daemon needed; CUDA tensors when a
GPU is there, CPU tensors otherwise. Prints a table (and JSON with --json)."""
import argparse
import json
import statistics
import time

import torch


def per_call_us(fn, calls=2000, rounds=7):
    medians = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        medians.append((time.perf_counter_ns() - start) / calls / 1e3)
    return statistics.median(medians)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    x = torch.empty(128, 7168, dtype=torch.bfloat16, device=dev)
    scales = torch.empty(36, 56, 256, dtype=torch.float32, device=dev)
    cuda = dev.type == "cuda"
    ops = {
        "t.dtype": lambda: x.dtype,
        "t.dim()": lambda: x.dim(),
        "t.get_device()": lambda: x.get_device(),
        "t.is_contiguous()": lambda: x.is_contiguous(),
        "t.data_ptr()": lambda: x.data_ptr(),
        "t.shape (unpacked)": lambda: (*x.shape,),
        "t.numel()": lambda: x.numel(),
        "t.device": lambda: x.device,
        "transpose(1, 2)": lambda: scales.transpose(1, 2),
        "torch.empty bf16 [36, 1024, 7168]": lambda: torch.empty(36, 1024, 7168, dtype=torch.bfloat16, device=dev),
        "torch.empty int32 [36]": lambda: torch.empty(36, dtype=torch.int32, device=dev),
        "view chain (uint8 -> slice -> dtype -> shape)": lambda: x.view(torch.uint8).view(-1)[0:1024].view(
            torch.bfloat16).view(4, 128),
    }
    if cuda:
        ops["torch.cuda.current_stream(dev).cuda_stream"] = lambda: torch.cuda.current_stream(dev).cuda_stream
        ops["torch.cuda.current_stream().cuda_stream"] = lambda: torch.cuda.current_stream().cuda_stream
        ops["torch.cuda.current_device()"] = torch.cuda.current_device
        ops["torch._C._cuda_getCurrentRawStream(0)"] = lambda: torch._C._cuda_getCurrentRawStream(0)
    results = {name: per_call_us(fn) for name, fn in ops.items()}
    print(f"torch {torch.__version__} on {dev} ({torch.cuda.get_device_name(0) if cuda else 'cpu'})")
    for name, us in results.items():
        print(f"{name:50s} {us:8.3f} us")
    if opts.json:
        print(json.dumps({"device": str(dev), "torch": torch.__version__, "us": results}))


if __name__ == "__main__":
    main()
