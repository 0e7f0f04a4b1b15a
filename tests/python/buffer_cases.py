"""Shared by the epfabric.Buffer tests (buffer_normal_test, buffer_low_latency_test): routing and inputs from a
seeded generator (the seed is printed), references computed with torch, and a fabric of host-backend daemons per test
class whose groups every rank attaches in its own thread."""
import os
import random
import threading
import unittest

import fabric

if fabric.BACKEND == "cuda":
    # The ranks of these tests are threads of one process sharing one CUDA context. CUDA loads kernels lazily (torch
    # asks for it), and loading a kernel waits for the kernels running on the device: a rank whose first torch op
    # (or first library call) loads code while a peer's library kernel already waits for this rank stalls until that
    # kernel times out. Everything is loaded when the context is made instead (before torch makes it; a process per
    # rank, as servers run, does not need this).
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

fabric.require_torch()
import torch  # noqa: E402

import epfabric  # noqa: E402

N = fabric.RANKS
SEED = int(os.environ.get("EPF_TEST_SEED", random.randrange(1 << 30)))
print(f"seed {SEED} (EPF_TEST_SEED)", flush=True)


def topk_routing(gen, num_tokens, num_experts, topk, drop=0.2):
    """Distinct experts per token, a fraction of the entries -1 (DeepEP's tests do the same)."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    idx = scores.topk(topk, dim=1).indices.to(torch.int64)
    idx[torch.rand(num_tokens, topk, generator=gen) < drop] = -1
    return idx


def bf16(gen, *shape):
    return (torch.randn(*shape, generator=gen) * 2).to(torch.bfloat16)


def torch_layout(topk_idx, num_experts, n):
    valid = topk_idx >= 0
    per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    in_rank = torch.zeros(topk_idx.shape[0], n, dtype=torch.bool)
    for r in range(n):
        lo, hi = r * num_experts // n, (r + 1) * num_experts // n
        in_rank[:, r] = ((topk_idx >= lo) & (topk_idx < hi)).any(1)
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank


def synchronized_buffer_class(n):
    """An epfabric.Buffer whose ranks, threads of this process, synchronize through a threading.Barrier where
    epfabric.deep_ep.Buffer's use their process group: around making or replacing a C Buffer (_sync_ranks) and to
    agree on the most tokens of a call (_agree_max). deep_ep_test and elastic_test run the process-group ones."""
    barrier = threading.Barrier(n)
    values = {}

    class Synchronized(epfabric.Buffer):
        def _sync_ranks(self):
            barrier.wait(60)
            return True

        def _agree_max(self, value):
            values[self.rank] = value
            barrier.wait(60)
            most = max(values.values())
            barrier.wait(60)
            return most

    return Synchronized


class FabricCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.fabric = fabric.Fabric(N).__enter__()
        cls.client = epfabric.Client(cls.fabric.sockets[0])
        cls.count = 0

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.fabric.stop()

    def group(self, low_latency, max_tokens, hidden, topk, num_experts, enable_shrink=False, buffer_class=None):
        type(self).count += 1
        name = f"py-{'ll' if low_latency else 'normal'}-{type(self).count}"
        nvl, rdma = epfabric.required_group_bytes(max_tokens, hidden, topk, num_experts, low_latency, 1, N)
        token = self.client.create_group(name, list(range(N)), nvl, rdma, low_latency)
        self.addCleanup(self.client.delete_group, name, token)
        # Normal mode makes its C Buffers at the calls, on every rank at once: the ranks synchronize around that.
        attach = (buffer_class or (epfabric.Buffer if low_latency else synchronized_buffer_class(N))).attach
        buffers = fabric.run_ranks(N, lambda r: attach(self.fabric.sockets[r], name, r, token,
                                                       enable_shrink=enable_shrink, **fabric.attach_options(N)))
        self.addCleanup(lambda: [b.destroy() for b in buffers])
        if low_latency and fabric.BACKEND == "cuda":
            # The library Buffer is made at the first call (it fixes the shape); made here for every rank before any
            # rank launches, since making it allocates device memory (see fabric.run_ranks).
            fabric.run_ranks(N, lambda r: buffers[r]._ensure_low_latency(max_tokens, hidden, topk, num_experts))
        return buffers


def dequant(data, scales):
    """fp8 e4m3 bytes [.., n, hidden] times scales [.., n, hidden / 128]."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None and data.dtype == fp8:
        values = data.float()
    else:
        values = e4m3_to_float(data.view(torch.uint8))
    return values * scales.float().repeat_interleave(128, dim=-1)


def e4m3_to_float(b):
    b = b.to(torch.int32)
    sign = torch.where(b & 0x80 != 0, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).float()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).float())
    sub = (man / 8) * 2.0 ** -6
    return sign * torch.where(exp == 0, sub, normal)
