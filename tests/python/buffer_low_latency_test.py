"""epfabric.Buffer's low latency from Python against real host-backend daemons: BF16 and FP8 dispatch, hooks, zero
copy, wait-cost statistics, the rank mask and CUDA graphs, checked element by element against references computed
with torch from all ranks' inputs (fresh random inputs per run; the seed is printed)."""
import threading
import unittest
import warnings

import fabric
from buffer_cases import N, SEED, FabricCase, bf16, dequant, topk_routing

fabric.require_torch()
import torch  # noqa: E402


class LowLatencyTest(FabricCase):
    hidden, topk, experts, max_tokens = 256, 4, 16, 16

    def group(self, *args, **kwargs):
        bufs = super().group(*args, **kwargs)
        if fabric.BACKEND == "cuda":
            fabric.run_ranks(N, lambda r: self.load_torch_kernels(bufs[r].device))
        return bufs

    def load_torch_kernels(self, device):
        """Runs the torch operations of run_round once on outputs of the library's shapes and strides, before any rank
        launches: CUDA loads a kernel at its first launch, and loading waits for the kernels running on the device, so a
        rank whose first dequantisation came while its peer's combine waited for it stalled until that wait timed out
        (ranks here are threads sharing one GPU; the library loads its own kernels when a Buffer is made)."""
        L, G, slots = self.experts // N, self.hidden // 128, N * self.max_tokens
        fp8 = getattr(torch, "float8_e4m3fn", None) or torch.uint8
        data = torch.zeros(L, slots, self.hidden, dtype=fp8, device=device)
        scales = torch.ones(L, G, slots, device=device).transpose(1, 2)
        expert_out = dequant(data, scales).to(torch.bfloat16)
        expert_out.clone()
        torch.empty_like(expert_out).copy_(expert_out)
        torch.zeros(L, dtype=torch.int32, device=device).tolist()
        torch.cuda.synchronize(device)

    def run_round(self, bufs, ins, use_fp8, zero_copy=False, hook=False, out=False, logfmt=False):
        def rank(r):
            b = bufs[r]
            x, idx, w = fabric.to_dev(*ins[r])
            stats = torch.zeros(self.experts // N, dtype=torch.int32, device=x.device)
            recv, count, handle, _, recv_hook = b.low_latency_dispatch(
                x, idx, self.max_tokens, self.experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                return_recv_hook=hook)
            if hook:
                recv_hook()
            data = recv[0] if use_fp8 else recv
            if use_fp8:  # expert "computation": dequantize (scales are per 128 columns)
                expert_out = dequant(data, recv[1]).to(torch.bfloat16)
            else:
                expert_out = data.clone()
            dst = torch.empty(x.shape[0], self.hidden, dtype=torch.bfloat16, device=x.device) if out else None
            if zero_copy:
                b.get_next_low_latency_combine_buffer(handle).copy_(expert_out)
            combined, _, combine_hook = b.low_latency_combine(expert_out, idx, w, handle, zero_copy=zero_copy,
                                                              return_recv_hook=hook, out=dst, use_logfmt=logfmt)
            if hook:
                combine_hook()
            if out:
                self.assertEqual(combined.data_ptr(), dst.data_ptr())
            b.check()  # a wait that timed out in this round fails it here, naming the rank
            mask = torch.zeros(N, dtype=torch.int32, device=x.device)
            b.low_latency_query_mask_buffer(mask)
            self.assertEqual(mask.tolist(), [0] * N, f"rank {r}: masked ranks after the round")
            return data, (recv[1] if use_fp8 else None), count, handle, stats, combined

        return fabric.run_ranks(N, rank)

    def check(self, ins, outs, use_fp8):
        L = self.experts // N
        for r in range(N):
            data, scales, count, handle, stats, combined = outs[r]
            src_info, layout_range = handle[0], handle[1]
            self.assertEqual(tuple(data.shape), (L, N * self.max_tokens, self.hidden))
            for le in range(L):
                e = r * L + le
                total = 0
                for s, (x, idx, _) in enumerate(ins):
                    begin, n = int(layout_range[le, s]) >> 32, int(layout_range[le, s]) & 0xFFFFFFFF
                    want_tokens = sorted(int(t) for t in (idx == e).any(1).nonzero().flatten())
                    got_tokens = src_info[le, begin:begin + n].tolist()
                    self.assertEqual(sorted(got_tokens), want_tokens, f"rank {r} expert {le} source {s}: tokens")
                    rows = data[le, begin:begin + n]
                    if use_fp8:
                        got = dequant(rows.unsqueeze(0), scales[le, begin:begin + n].unsqueeze(0))[0]
                        torch.testing.assert_close(got, x[got_tokens].float(), rtol=0.07, atol=0.02)
                    else:
                        self.assertTrue(torch.equal(rows, x[got_tokens]), f"rank {r} expert {le} source {s}: rows")
                    total += n
                self.assertEqual(int(count[le]), total, f"rank {r} expert {le}: packed_recv_count")
                self.assertEqual(int(stats[le]), total, f"rank {r} expert {le}: cumulative stats")
        for r, (x, idx, w) in enumerate(ins):
            combined = outs[r][5]
            weight = torch.where(idx >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
            tol = dict(rtol=0.08, atol=0.05) if use_fp8 else dict(rtol=2 ** -7, atol=1e-2)
            torch.testing.assert_close(combined.float(), x.float() * weight, **tol,
                                       msg=lambda m: f"rank {r}: combined_x: {m}")

    def inputs(self, seed):
        gens = [torch.Generator().manual_seed(seed + r) for r in range(N)]
        return [(bf16(gens[r], self.max_tokens - r, self.hidden),
                 topk_routing(gens[r], self.max_tokens - r, self.experts, self.topk),
                 torch.rand(self.max_tokens - r, self.topk, generator=gens[r])) for r in range(N)]

    def test_bf16_fp8_hooks_zero_copy_out(self):
        bufs = self.group(True, self.max_tokens, self.hidden, self.topk, self.experts)
        for i, kw in enumerate([dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=False, hook=True),
                                dict(use_fp8=False, zero_copy=True), dict(use_fp8=True, out=True, hook=True),
                                dict(use_fp8=False, logfmt=True)]):
            with self.subTest(**kw):
                ins = self.inputs(SEED + 1000 * i)
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    outs = self.run_round(bufs, ins, **kw)
                self.check(ins, outs, kw["use_fp8"])
                # use_logfmt runs the exact BF16 combine and says so (docs/python.md)
                self.assertEqual(any("use_logfmt" in str(w.message) for w in said), kw.get("logfmt", False))

    def test_wait_recv_cost_stats(self):
        """DeepEP's wait-cost statistics: int64 [num_ranks], only added to (ns here); every call adds at least 1 per
        wait to every rank that sent (dispatch: one wait per local expert and source, combine: one per call)."""
        bufs = self.group(True, self.max_tokens, self.hidden, self.topk, self.experts)
        L = self.experts // N

        def rank(r, ins, costs):
            x, idx, w = fabric.to_dev(*ins[r])
            recv, _, handle, _, _ = bufs[r].low_latency_dispatch(x, idx, self.max_tokens, self.experts, use_fp8=False,
                                                                 dispatch_wait_recv_cost_stats=costs[r][0])
            combined, _, _ = bufs[r].low_latency_combine(recv, idx, w, handle, combine_wait_recv_cost_stats=costs[r][1])
            bufs[r].check()
            return costs[r][0].clone().cpu(), costs[r][1].clone().cpu()

        costs = [tuple(torch.zeros(N, dtype=torch.int64, device=b.device) for _ in range(2)) for b in bufs]
        last = [(torch.zeros(N, dtype=torch.int64), torch.zeros(N, dtype=torch.int64)) for _ in range(N)]
        for i in range(2):
            ins = self.inputs(SEED + 40 + i)
            for r, (dispatch_cost, combine_cost) in enumerate(fabric.run_ranks(N, lambda r: rank(r, ins, costs))):
                self.assertTrue(bool((dispatch_cost - last[r][0] >= L).all()),
                                f"call {i} rank {r}: dispatch wait costs {last[r][0].tolist()} -> "
                                f"{dispatch_cost.tolist()}")
                self.assertTrue(bool((combine_cost - last[r][1] >= 1).all()),
                                f"call {i} rank {r}: combine wait costs {last[r][1].tolist()} -> "
                                f"{combine_cost.tolist()}")
                last[r] = (dispatch_cost, combine_cost)
        x, idx, _ = fabric.to_dev(*self.inputs(SEED)[0])
        for bad, kind, needle in ((costs[0][0].int(), TypeError, "dtype"), (costs[0][0][:1], ValueError, "entries")):
            with self.assertRaises(kind) as caught:  # refused before anything reaches the library
                bufs[0].low_latency_dispatch(x, idx, self.max_tokens, self.experts, dispatch_wait_recv_cost_stats=bad)
            self.assertIn(needle, str(caught.exception))

    def test_the_mask_is_for_buffers_that_opted_in(self):
        """Without enable_shrink (DeepEP's default) nothing masks a rank: the mask reads all zero and cannot be set."""
        bufs = self.group(True, self.max_tokens, self.hidden, self.topk, self.experts)
        ins = self.inputs(SEED + 13)
        self.check(ins, self.run_round(bufs, ins, use_fp8=False), False)
        with self.assertRaisesRegex(RuntimeError, "enable_shrink=True"):
            bufs[0].low_latency_update_mask_buffer(N - 1, True)
        status = torch.ones(N, dtype=torch.int32, device=bufs[0].device)
        bufs[0].low_latency_query_mask_buffer(status)
        self.assertEqual(status.tolist(), [0] * N)

    def test_mask_a_rank_then_clean(self):
        """Elastic EP: every other rank masks the last one (as if it were gone) and runs without it; then the masks
        are cleaned, every rank resets, and the full group works again."""
        bufs = self.group(True, self.max_tokens, self.hidden, self.topk, self.experts, enable_shrink=True)
        ins = self.inputs(SEED + 11)
        self.check(ins, self.run_round(bufs, ins, use_fp8=False), False)  # sets the Buffers up
        gone, L = N - 1, self.experts // N

        def masked(r):
            if r == gone:
                return None
            b = bufs[r]
            x, idx, w = fabric.to_dev(*ins[r])
            b.low_latency_update_mask_buffer(gone, True)
            status = torch.zeros(N, dtype=torch.int32, device=x.device)
            b.low_latency_query_mask_buffer(status)
            recv, count, handle, _, _ = b.low_latency_dispatch(x, idx, self.max_tokens, self.experts, use_fp8=False)
            combined, _, _ = b.low_latency_combine(recv, idx, w, handle)  # experts return their rows unchanged
            return status, count, combined

        outs = fabric.run_ranks(N, masked)
        for r in range(N - 1):
            status, count, combined = outs[r]
            self.assertEqual(status.tolist(), [1 if q == gone else 0 for q in range(N)], f"rank {r}: mask status")
            for le in range(L):
                want = sum(int((idx == r * L + le).any(1).sum()) for s, (_, idx, _) in enumerate(ins) if s != gone)
                self.assertEqual(int(count[le]), want, f"rank {r} expert {le}: nothing from the masked rank")
            x, idx, w = ins[r]
            alive = (idx >= 0) & (idx < gone * L)  # experts on the masked rank count as zero
            weight = torch.where(alive, w, torch.zeros_like(w)).sum(1, keepdim=True)
            torch.testing.assert_close(combined.float(), x.float() * weight, rtol=2 ** -7, atol=1e-2,
                                       msg=lambda m: f"rank {r}: combined without the masked rank: {m}")

        def clean(r):
            bufs[r].low_latency_clean_mask_buffer()
            bufs[r].clean_low_latency_buffer(self.max_tokens, self.hidden, self.experts)
            status = torch.ones(N, dtype=torch.int32, device=bufs[r].device)
            bufs[r].low_latency_query_mask_buffer(status)
            return status

        for status in fabric.run_ranks(N, clean):
            self.assertEqual(status.tolist(), [0] * N)
        ins = self.inputs(SEED + 12)
        self.check(ins, self.run_round(bufs, ins, use_fp8=False), False)

    @unittest.skipUnless(fabric.BACKEND == "cuda", "CUDA graphs need the cuda backend (EPF_PY_BACKEND=cuda)")
    def test_cuda_graph_capture_and_replay(self):
        bufs = self.group(True, self.max_tokens, self.hidden, self.topk, self.experts)
        ins = self.inputs(SEED + 7)
        warm, capture = threading.Barrier(N), threading.Lock()

        def rank(r):
            b = bufs[r]
            x, idx, w = fabric.to_dev(*ins[r])
            static_x = x.clone()
            recv, _, handle, _, _ = b.low_latency_dispatch(static_x, idx, self.max_tokens, self.experts, use_fp8=False)
            b.low_latency_combine(recv, idx, w, handle)  # eager warm-up: the Buffer exists before the capture
            torch.cuda.current_stream().synchronize()
            warm.wait()
            graph = torch.cuda.CUDAGraph()
            with capture:  # one capture at a time in this process (torch synchronises the device around them)
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    recv, _, handle, _, _ = b.low_latency_dispatch(static_x, idx, self.max_tokens, self.experts,
                                                                   use_fp8=False)
                    combined, _, _ = b.low_latency_combine(recv, idx, w, handle)
            warm.wait()
            outs = []
            for i in range(5):  # new inputs each replay, written into the captured input tensor
                static_x.copy_((x.float() * (i + 1)).to(torch.bfloat16))
                graph.replay()
                outs.append(combined.clone())
            return outs

        outs = fabric.run_ranks(N, rank)
        for r, (x, idx, w) in enumerate(ins):
            weight = torch.where(idx >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
            for i, combined in enumerate(outs[r]):
                want = (x.float() * (i + 1)).to(torch.bfloat16).float() * weight
                torch.testing.assert_close(combined.float(), want, rtol=2 ** -7, atol=2e-2,
                                           msg=lambda m: f"rank {r} replay {i}: {m}")


if __name__ == "__main__":
    fabric.main()
