"""epfabric.Buffer from Python against real host-backend daemons: every DeepEP method, checked element by element
against references computed with torch from all ranks' inputs (fresh random inputs per run; the seed is printed)."""
import os
import random
import threading
import unittest
import warnings

import fabric

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
        attach = (buffer_class or epfabric.Buffer).attach
        buffers = fabric.run_ranks(N, lambda r: attach(self.fabric.sockets[r], name, r, token,
                                                       enable_shrink=enable_shrink, **fabric.attach_options(N)))
        self.addCleanup(lambda: [b.destroy() for b in buffers])
        if low_latency and fabric.BACKEND == "cuda":
            # The library Buffer is made at the first call (it fixes the shape); made here for every rank before any
            # rank launches, since making it allocates device memory (see fabric.run_ranks).
            fabric.run_ranks(N, lambda r: buffers[r]._ensure_low_latency(max_tokens, hidden, topk, num_experts))
        return buffers


class NormalModeTest(FabricCase):
    hidden, topk, experts, tokens = 256, 4, 16, 48

    def inputs(self, gen, r, num_tokens=None):
        n = self.tokens - 7 * r if num_tokens is None else num_tokens
        idx = topk_routing(gen, n, self.experts, self.topk)
        return bf16(gen, n, self.hidden), idx, torch.rand(n, self.topk, generator=gen)

    def check_dispatch(self, r, ins, recv_x, recv_idx, recv_w, counts):
        L = self.experts // N
        rows, idx_rows, w_rows = [], [], []
        for x, idx, w in ins:
            here = ((idx >= r * L) & (idx < (r + 1) * L))
            sel = here.any(1)
            rows.append(x[sel])
            idx_rows.append(torch.where(here, idx - r * L, torch.full_like(idx, -1))[sel])
            w_rows.append(torch.where(here, w, torch.zeros_like(w))[sel])
        self.assertTrue(torch.equal(recv_x, torch.cat(rows)), f"rank {r}: recv_x differs from the reference")
        self.assertTrue(torch.equal(recv_idx, torch.cat(idx_rows)), f"rank {r}: recv_topk_idx differs")
        self.assertTrue(torch.equal(recv_w, torch.cat(w_rows)), f"rank {r}: recv_topk_weights differ")
        if counts is not None:  # None: not returned (worst-case mode)
            want = [sum(int((idx == r * L + e).sum()) for _, idx, _ in ins) for e in range(L)]
            self.assertEqual(counts, want, f"rank {r}: num_recv_tokens_per_expert_list")

    def test_dispatch_combine_layout_cached_bias(self):
        bufs = self.group(False, 64, self.hidden, self.topk, self.experts)
        gens = [torch.Generator().manual_seed(SEED + r) for r in range(N)]
        ins = [self.inputs(gens[r], r) for r in range(N)]
        biases = [bf16(gens[r], ins[r][0].shape[0], self.hidden) for r in range(N)]

        def rank(r):
            b = bufs[r]
            x, idx, w = fabric.to_dev(*ins[r])
            bias = fabric.to_dev(biases[r])
            out = {}
            for round_ in range(2):  # the first layout is torch's, the second the library's
                per_rank, per_rdma, per_expert, in_rank, event = b.get_dispatch_layout(idx, self.experts)
                ref = torch_layout(idx.cpu(), self.experts, N)
                self.assertIsNone(per_rdma)
                for got, want, name in zip((per_rank, per_expert, in_rank), ref, ("per rank", "per expert", "in rank")):
                    self.assertTrue(torch.equal(got.cpu(), want), f"rank {r} round {round_}: layout {name}")
                recv_x, recv_idx, recv_w, counts, handle, _ = b.dispatch(
                    x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=idx, topk_weights=w)
                out.setdefault("recv", []).append((recv_x, recv_idx, recv_w, counts))
                expert_out = (recv_x.float() * (r + 1)).to(torch.bfloat16)
                combined, combined_w, _ = b.combine(expert_out, handle, topk_weights=recv_w, bias=(bias, None))
                out.setdefault("combined", []).append((combined, combined_w))
            cached_x, cached_idx, cached_w, cached_counts, _, _ = b.dispatch(x, handle=handle)
            out["cached"] = (cached_x, cached_idx, cached_w, cached_counts)
            return out

        outs = fabric.run_ranks(N, rank)
        for r in range(N):
            for recv in outs[r]["recv"]:
                self.check_dispatch(r, ins, *recv)
            cached_x, cached_idx, cached_w, cached_counts = outs[r]["cached"]
            self.assertTrue(torch.equal(cached_x, outs[r]["recv"][0][0]), f"rank {r}: cached dispatch recv_x")
            self.assertIsNone(cached_idx)
            self.assertEqual(cached_counts, [])
            x, idx, w = ins[r]
            L = self.experts // N
            acc = torch.zeros(x.shape[0], self.hidden)
            acc_w = torch.zeros(x.shape[0], self.topk)
            for d in range(N):  # each rank d that received the token returns x * (d + 1) in bf16
                here = (idx >= d * L) & (idx < (d + 1) * L)
                sel = here.any(1)
                acc[sel] += (x.float() * (d + 1)).to(torch.bfloat16).float()[sel]
                acc_w += torch.where(here, w, torch.zeros_like(w))
            want = (acc + biases[r].float()).to(torch.bfloat16)
            for combined, combined_w in outs[r]["combined"]:
                torch.testing.assert_close(combined.float(), want.float(), rtol=2 ** -7, atol=1e-2,
                                           msg=lambda m: f"rank {r}: combined_x: {m}")
                torch.testing.assert_close(combined_w, acc_w, rtol=1e-6, atol=1e-6)

    def test_fp8_dispatch_and_worst_tokens(self):
        bufs = self.group(False, 64, self.hidden, self.topk, self.experts)
        gens = [torch.Generator().manual_seed(SEED + 100 + r) for r in range(N)]
        ins = []
        for r in range(N):
            x, idx, w = self.inputs(gens[r], r)
            data = torch.randint(0, 0x7f, (x.shape[0], self.hidden), dtype=torch.uint8, generator=gens[r])
            scales = torch.rand(self.hidden // 128, x.shape[0], generator=gens[r]).t()  # column-major, as DeepEP
            ins.append((data, scales, idx, w))

        def rank(r):
            data, idx, w = fabric.to_dev(ins[r][0], ins[r][2], ins[r][3])
            scales = ins[r][1].cuda() if fabric.BACKEND == "cuda" else ins[r][1]  # keeps its column-major strides
            per_rank, _, per_expert, in_rank, _ = bufs[r].get_dispatch_layout(idx, self.experts)
            return bufs[r].dispatch((data, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                    num_worst_tokens=N * self.tokens)

        outs = fabric.run_ranks(N, rank)
        L = self.experts // N
        for r in range(N):
            (recv_data, recv_scales), recv_idx, _, counts, handle, _ = outs[r]
            sel = [((idx >= r * L) & (idx < (r + 1) * L)).any(1) for _, _, idx, _ in ins]
            want_data = torch.cat([d[s] for (d, _, _, _), s in zip(ins, sel)])
            want_scales = torch.cat([sc[s] for (_, sc, _, _), s in zip(ins, sel)])
            n = want_data.shape[0]
            self.assertEqual(recv_data.shape[0], N * self.tokens, "num_worst_tokens rows")
            self.assertEqual(recv_scales.shape[0], N * self.tokens, "num_worst_tokens rows")
            self.assertEqual(handle.num_recv_tokens, N * self.tokens, "the handle's rows are num_worst_tokens")
            self.assertTrue(torch.equal(recv_data[:n].view(torch.uint8), want_data), f"rank {r}: fp8 bytes")
            self.assertTrue(torch.equal(recv_scales[:n], want_scales), f"rank {r}: scales")
            self.assertTrue(bool((recv_idx[n:] == -1).all()), "padded rows have top-k -1")
            self.assertEqual(counts, [])

    def test_fp8_packed_ue8m0_scales(self):
        """DeepEP's int scales: packed UE8M0 int32 [tokens, hidden / 512] (column-major here, as DeepGEMM makes them)
        travel with their tokens and come back as int32 [received, hidden / 512]."""
        hidden = 1024
        bufs = self.group(False, 64, hidden, self.topk, self.experts)
        ins = []
        for r in range(N):
            gen = torch.Generator().manual_seed(SEED + 500 + r)
            _, idx, w = self.inputs(gen, r)
            n = idx.shape[0]
            data = torch.randint(0, 0x7f, (n, hidden), dtype=torch.uint8, generator=gen)
            words = torch.randint(-(1 << 31), (1 << 31) - 1, (hidden // 512, n), dtype=torch.int32, generator=gen).t()
            ins.append((data, words, idx, w))

        def rank(r):
            data, idx, w = fabric.to_dev(ins[r][0], ins[r][2], ins[r][3])
            words = ins[r][1].cuda() if fabric.BACKEND == "cuda" else ins[r][1]  # keeps its column-major strides
            per_rank, _, per_expert, in_rank, _ = bufs[r].get_dispatch_layout(idx, self.experts)
            return bufs[r].dispatch((data, words), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

        outs = fabric.run_ranks(N, rank)
        L = self.experts // N
        for r in range(N):
            (recv_data, recv_words), recv_idx, _, _, _, _ = outs[r]
            sel = [((idx >= r * L) & (idx < (r + 1) * L)).any(1) for _, _, idx, _ in ins]
            want_words = torch.cat([words[s] for (_, words, _, _), s in zip(ins, sel)])
            self.assertEqual(recv_words.dtype, torch.int32, f"rank {r}: received scales keep their dtype")
            self.assertEqual(tuple(recv_words.shape), (want_words.shape[0], hidden // 512))
            self.assertTrue(torch.equal(recv_words.cpu(), want_words), f"rank {r}: packed scale words")
            want_data = torch.cat([d[s] for (d, _, _, _), s in zip(ins, sel)])
            self.assertTrue(torch.equal(recv_data.view(torch.uint8).cpu(), want_data), f"rank {r}: fp8 bytes")
        data, words, idx, _ = fabric.to_dev(*ins[0])
        per_rank, _, per_expert, in_rank, _ = bufs[0].get_dispatch_layout(idx, self.experts)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        for bad, kind, needle in (((data, words.long()), TypeError, "x[1] (scales).dtype"),
                                  ((data[:, :640].contiguous(), words[:, :1]), epfabric.EpfError, "multiple of 512")):
            with self.assertRaises(kind) as caught:  # refused before anything is launched
                bufs[0].dispatch(bad, **layout, topk_idx=idx)
            self.assertIn(needle, str(caught.exception))

    def test_worst_tokens_equals_the_waiting_path(self):
        """num_worst_tokens (no host wait): the received rows equal the normal path's, the padding rows have top-k
        -1 and weight 0, and a combine through the worst-case handle (padding rows of NaN) equals the normal one."""
        bufs = self.group(False, 64, self.hidden, self.topk, self.experts)
        gens = [torch.Generator().manual_seed(SEED + 200 + r) for r in range(N)]
        ins = [self.inputs(gens[r], r) for r in range(N)]
        worst = N * self.tokens + 5  # more than any rank can receive

        def rank(r):
            b = bufs[r]
            x, idx, w = fabric.to_dev(*ins[r])
            per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, self.experts)
            layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
            want = b.dispatch(x, **layout, topk_idx=idx, topk_weights=w)
            got = b.dispatch(x, **layout, topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
            n = want[0].shape[0]
            expert_out = (want[0].float() * (r + 2)).to(torch.bfloat16)
            padded = torch.full((worst, self.hidden), float("nan"), dtype=torch.bfloat16, device=x.device)
            padded[:n] = expert_out
            padded_w = torch.full((worst, self.topk), 1e30, device=x.device)
            padded_w[:n] = want[2]
            combined_want = b.combine(expert_out, want[4], topk_weights=want[2])
            combined_got = b.combine(padded, got[4], topk_weights=padded_w)
            cached = b.dispatch(x, handle=got[4])  # through the worst-case handle: worst rows again
            return want, got, combined_want, combined_got, cached

        for r, (want, got, combined_want, combined_got, cached) in enumerate(fabric.run_ranks(N, rank)):
            n = want[0].shape[0]
            self.check_dispatch(r, ins, *[t.cpu() if t is not None else t for t in want[:3]], want[3])
            for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
                self.assertEqual(got[i].shape[0], worst, f"rank {r}: {name} has num_worst_tokens rows")
                self.assertTrue(torch.equal(got[i][:n], want[i]), f"rank {r}: {name} differs from the waiting path")
            self.assertTrue(bool((got[1][n:] == -1).all()), f"rank {r}: padding top-k indices are -1")
            self.assertTrue(bool((got[2][n:] == 0).all()), f"rank {r}: padding top-k weights are 0")
            self.assertEqual(got[3], [], f"rank {r}: num_recv_tokens_per_expert_list is empty")
            self.assertEqual(got[4].num_recv_tokens, worst)
            self.assertTrue(torch.equal(combined_got[0], combined_want[0]), f"rank {r}: combined_x")
            self.assertTrue(torch.equal(combined_got[1], combined_want[1]), f"rank {r}: combined_topk_weights")
            self.assertEqual(cached[0].shape[0], worst, f"rank {r}: cached dispatch through the worst-case handle")
            self.assertTrue(torch.equal(cached[0][:n], want[0]), f"rank {r}: cached recv_x")
        with self.assertRaises(ValueError) as caught:  # refused before anything reaches the library
            bufs[0].dispatch(fabric.to_dev(ins[0][0])[0], num_worst_tokens=-1)
        self.assertIn("num_worst_tokens = -1", str(caught.exception))

    @unittest.skipUnless(fabric.BACKEND == "cuda", "CUDA graphs need the cuda backend (EPF_PY_BACKEND=cuda)")
    def test_worst_tokens_cuda_graph_capture_and_replay(self):
        """Layout + worst-case dispatch + combine captured in a CUDA graph, replayed with new routing each time."""
        bufs = self.group(False, 64, self.hidden, self.topk, self.experts)
        worst = N * 64
        warm, capture = threading.Barrier(N), threading.Lock()
        rounds = [[self.inputs(torch.Generator().manual_seed(SEED + 300 + 10 * i + r), r, self.tokens)
                   for r in range(N)] for i in range(4)]

        def rank(r):
            b = bufs[r]
            x, idx, w = fabric.to_dev(*rounds[0][r])
            static = [x.clone(), idx.clone(), w.clone()]

            def step():
                per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(static[1], self.experts)
                recv_x, recv_idx, recv_w, _, handle, _ = b.dispatch(
                    static[0], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=static[1], topk_weights=static[2],
                    num_worst_tokens=worst)
                combined, combined_w, _ = b.combine(recv_x, handle, topk_weights=recv_w)
                return recv_x, recv_idx, recv_w, combined, combined_w

            step()  # eager warm-up: the Buffer exists before the capture
            torch.cuda.current_stream().synchronize()
            warm.wait()
            graph = torch.cuda.CUDAGraph()
            with capture:
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    outs = step()
            warm.wait()
            got = []
            for i in range(len(rounds)):
                for t, v in zip(static, fabric.to_dev(*rounds[i][r])):
                    t.copy_(v)
                graph.replay()
                b.check()
                got.append([t.clone().cpu() for t in outs])
            return got

        got = fabric.run_ranks(N, rank)
        L = self.experts // N
        for i, ins in enumerate(rounds):
            for r in range(N):
                recv_x, recv_idx, recv_w, combined, combined_w = got[r][i]
                n = sum(int(((idx >= r * L) & (idx < (r + 1) * L)).any(1).sum()) for _, idx, _ in ins)
                self.check_dispatch(r, ins, recv_x[:n], recv_idx[:n], recv_w[:n], None)
                self.assertTrue(bool((recv_idx[n:] == -1).all()), f"replay {i} rank {r}: padding top-k")
                x, idx, w = ins[r]
                ranks = torch.stack([((idx >= d * L) & (idx < (d + 1) * L)).any(1) for d in range(N)], 1)
                want = x.float() * ranks.sum(1, keepdim=True)
                torch.testing.assert_close(combined.float(), want, rtol=2 ** -7, atol=2e-2,
                                           msg=lambda m: f"replay {i} rank {r}: combined_x: {m}")


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
        expert_out = _dequant(data, scales).to(torch.bfloat16)
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
                expert_out = _dequant(data, recv[1]).to(torch.bfloat16)
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
            for l in range(L):
                e = r * L + l
                total = 0
                for s, (x, idx, _) in enumerate(ins):
                    begin, n = int(layout_range[l, s]) >> 32, int(layout_range[l, s]) & 0xFFFFFFFF
                    want_tokens = sorted(int(t) for t in (idx == e).any(1).nonzero().flatten())
                    got_tokens = src_info[l, begin:begin + n].tolist()
                    self.assertEqual(sorted(got_tokens), want_tokens, f"rank {r} expert {l} source {s}: tokens")
                    rows = data[l, begin:begin + n]
                    if use_fp8:
                        got = _dequant(rows.unsqueeze(0), scales[l, begin:begin + n].unsqueeze(0))[0]
                        torch.testing.assert_close(got, x[got_tokens].float(), rtol=0.07, atol=0.02)
                    else:
                        self.assertTrue(torch.equal(rows, x[got_tokens]), f"rank {r} expert {l} source {s}: rows")
                    total += n
                self.assertEqual(int(count[l]), total, f"rank {r} expert {l}: packed_recv_count")
                self.assertEqual(int(stats[l]), total, f"rank {r} expert {l}: cumulative stats")
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

        costs = [(torch.zeros(N, dtype=torch.int64, device=b.device),
                  torch.zeros(N, dtype=torch.int64, device=b.device))
                 for b in bufs]
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
            for l in range(L):
                want = sum(int((idx == r * L + l).any(1).sum()) for s, (_, idx, _) in enumerate(ins) if s != gone)
                self.assertEqual(int(count[l]), want, f"rank {r} expert {l}: nothing from the masked rank")
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


def _dequant(data, scales):
    """fp8 e4m3 bytes [.., n, hidden] times scales [.., n, hidden / 128]."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None and data.dtype == fp8:
        values = data.float()
    else:
        values = _e4m3_to_float(data.view(torch.uint8))
    return values * scales.float().repeat_interleave(128, dim=-1)


class PerCallShapeTest(FabricCase):
    """Shapes that change from call to call within the group's memory, as DeepEP's Buffer serves them. The ranks are
    threads of this process: their Buffers synchronize through a threading.Barrier where epfabric.deep_ep.Buffer's use
    the process group (deep_ep_test runs that one)."""
    hidden, topk, experts, tokens = 256, 4, 16, 24

    def test_normal_mode_replaces_its_c_buffer_for_another_shape(self):
        barrier = threading.Barrier(N)

        class Synchronized(epfabric.Buffer):
            def _sync_ranks(self):
                barrier.wait(60)
                return True

        bufs = self.group(False, 64, self.hidden, self.topk, self.experts, buffer_class=Synchronized)
        gens = [torch.Generator().manual_seed(SEED + r) for r in range(N)]
        ins = [(bf16(gens[r], self.tokens, self.hidden), topk_routing(gens[r], self.tokens, self.experts, self.topk),
                torch.rand(self.tokens, self.topk, generator=gens[r])) for r in range(N)]
        wide = 16 * self.hidden

        def rank(r):
            b = bufs[r]
            x, idx, w = fabric.to_dev(*ins[r])
            per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, self.experts)
            layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
            out = {}
            no_topk = b.dispatch(x, **layout)  # DeepEP's test_intranode starts without top-k: set up for top-1
            out["first"] = dict(b._cfg)
            recv_x, recv_idx, recv_w, counts, handle, _ = b.dispatch(x, **layout, topk_idx=idx, topk_weights=w)
            out["second"] = dict(b._cfg)
            out["recv"] = (recv_x, recv_idx, recv_w, counts)
            out["combined"] = b.combine(recv_x, handle)[0]
            with self.assertRaisesRegex(ValueError, "dispatch again"):  # its C Buffer was replaced
                b.combine(no_topk[0], no_topk[4])
            out["handle"] = (handle[0], handle[4] is in_rank, len(handle))
            big = torch.zeros(self.tokens, wide, dtype=torch.bfloat16, device=x.device)
            with self.assertRaises(ValueError) as caught:  # more than the group's memory: nothing is replaced
                b.dispatch(big, **layout, topk_idx=idx)
            out["refused"] = str(caught.exception)
            out["again"] = b.dispatch(x, **layout, topk_idx=idx, topk_weights=w)[:4]
            out["serial"], out["nvl_bytes"] = b._normal_serial, b.num_nvl_bytes
            return out

        outs = fabric.run_ranks(N, rank)
        need = epfabric.required_group_bytes(self.tokens, wide, self.topk, self.experts, False, 1, N)
        L = self.experts // N
        for r, out in enumerate(outs):
            self.assertEqual((out["first"]["hidden"], out["first"]["topk"]), (self.hidden, 1))
            self.assertEqual((out["second"]["hidden"], out["second"]["topk"]), (self.hidden, self.topk))
            self.assertEqual(out["serial"], 2, "the call that did not fit replaced nothing")
            NormalModeTest.check_dispatch(self, r, ins, *out["recv"])
            NormalModeTest.check_dispatch(self, r, ins, *out["again"])
            x, idx, _ = ins[r]
            ranks = torch.stack([((idx >= d * L) & (idx < (d + 1) * L)).any(1) for d in range(N)], 1).sum(1, True)
            torch.testing.assert_close(out["combined"].float(), x.float() * ranks, rtol=2 ** -7, atol=1e-2)
            self.assertIn(f"needs {need[0]} NVL and {need[1]} RDMA bytes per rank; the group has "
                          f"{out['nvl_bytes']} NVL and 0 RDMA bytes", out["refused"])
            prefix, same_in_rank, length = out["handle"]
            self.assertEqual(length, 6, "DeepEP's intranode handle has six fields")
            self.assertTrue(same_in_rank, "handle[4] is the dispatch's is_token_in_rank")
            # epfabric.Buffer has no way to gather the other ranks' counts: rank_prefix_matrix says so
            self.assertIsInstance(prefix, epfabric.UnavailableField)
            self.assertIn("EPFABRIC_RANK_PREFIX_MATRIX", repr(prefix))
            with self.assertRaisesRegex(NotImplementedError, "rank_prefix_matrix"):
                prefix[0]


def _e4m3_to_float(b):
    b = b.to(torch.int32)
    sign = torch.where(b & 0x80 != 0, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).float()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).float())
    sub = (man / 8) * 2.0 ** -6
    return sign * torch.where(exp == 0, sub, normal)


if __name__ == "__main__":
    fabric.main()
