"""epfabric.Buffer's normal mode from Python against real host-backend daemons: every DeepEP method, checked element
by element against references computed with torch from all ranks' inputs (fresh random inputs per run; the seed is
printed), and shapes that change from call to call."""
import threading
import unittest

import fabric
from buffer_cases import N, SEED, FabricCase, bf16, synchronized_buffer_class, topk_routing, torch_layout

fabric.require_torch()
import torch  # noqa: E402

import epfabric  # noqa: E402


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
            cached_x, cached_idx, cached_w, cached_counts, cached_handle, _ = b.dispatch(x, handle=handle)
            out["cached"] = (cached_x, cached_idx, cached_w, cached_counts, cached_handle)
            return out

        outs = fabric.run_ranks(N, rank)
        for r in range(N):
            for recv in outs[r]["recv"]:
                self.check_dispatch(r, ins, *recv)
            cached_x, cached_idx, cached_w, cached_counts, cached_handle = outs[r]["cached"]
            self.assertTrue(torch.equal(cached_x, outs[r]["recv"][0][0]), f"rank {r}: cached dispatch recv_x")
            # DeepEP's cached dispatch returns the rows and None for the rest (the handle stays the caller's)
            self.assertEqual((cached_idx, cached_w, cached_counts, cached_handle), (None, None, None, None))
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


class PerCallShapeTest(FabricCase):
    """Shapes that change from call to call within the group's memory, as DeepEP's Buffer serves them. The ranks are
    threads of this process: their Buffers synchronize through a threading.Barrier where epfabric.deep_ep.Buffer's use
    the process group (deep_ep_test runs that one)."""
    hidden, topk, experts, tokens = 256, 4, 16, 24

    def test_normal_mode_replaces_its_c_buffer_for_another_shape(self):
        bufs = self.group(False, 64, self.hidden, self.topk, self.experts, buffer_class=synchronized_buffer_class(N))
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
            # DeepEP's callers tune num_sms call by call: another Config runs on the C Buffer there (not replaced)
            tuned = b.dispatch(x, **layout, topk_idx=idx, topk_weights=w, config=epfabric.Config(num_sms=8))
            out["tuned"] = (tuned[:4], b._normal_serial, b.combine(tuned[0], tuned[4], config=epfabric.Config(4))[0])
            with self.assertRaisesRegex(ValueError, "dispatch again"):  # its C Buffer was replaced
                b.combine(no_topk[0], no_topk[4])
            out["handle"] = (handle[0], handle[4] is in_rank, len(handle))
            # A shape the C Buffer does not serve, that fits rank 0's tokens nowhere and the others' (2) easily: every
            # rank decides alike from the most tokens of any rank, so all refuse and none replaces its C Buffer.
            n = self.tokens if r == 0 else 2
            part = b.get_dispatch_layout(idx[:n], self.experts)
            with self.assertRaises(ValueError) as caught:
                b.dispatch(torch.zeros(n, 4 * self.hidden, dtype=torch.bfloat16, device=x.device),
                           num_tokens_per_rank=part[0], is_token_in_rank=part[3], num_tokens_per_expert=part[2],
                           topk_idx=idx[:n])
            out["uneven"] = (str(caught.exception), b._normal_serial)
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
            uneven, serial = out["uneven"]
            self.assertEqual(serial, 2, f"rank {r}: a refused call replaced the C Buffer")
            self.assertIn(f"a dispatch of {self.tokens} tokens of hidden {4 * self.hidden}", uneven,
                          f"rank {r} decides from the most tokens of any rank")
            NormalModeTest.check_dispatch(self, r, ins, *out["recv"])
            NormalModeTest.check_dispatch(self, r, ins, *out["again"])
            tuned, serial, tuned_combined = out["tuned"]
            NormalModeTest.check_dispatch(self, r, ins, *tuned)
            self.assertEqual(serial, 2, "a call with another Config.num_sms replaced the C Buffer")
            self.assertTrue(torch.equal(tuned_combined, out["combined"]), f"rank {r}: combine after a tuned dispatch")
            x, idx, _ = ins[r]
            ranks = torch.stack([((idx >= d * L) & (idx < (d + 1) * L)).any(1) for d in range(N)], 1).sum(1, True)
            torch.testing.assert_close(out["combined"].float(), x.float() * ranks, rtol=2 ** -7, atol=1e-2)
            self.assertIn(f"needs {need[0]} NVL and {need[1]} RDMA bytes per rank; the group has "
                          f"{out['nvl_bytes']} NVL and 0 RDMA bytes", out["refused"])
            prefix, same_in_rank, length = out["handle"]
            self.assertEqual(length, 6, "DeepEP's intranode handle has six fields")
            self.assertTrue(same_in_rank, "handle[4] is the dispatch's is_token_in_rank")
            # DeepEP's rank_prefix_matrix: [i][j] = tokens ranks 0..i send to rank j
            sent = torch.stack([torch.stack([((ids >= d * L) & (ids < (d + 1) * L)).any(1).sum() for d in range(N)])
                                for _, ids, _ in ins]).to(torch.int32)
            self.assertEqual(prefix.dtype, torch.int32)
            self.assertTrue(torch.equal(prefix.cpu(), sent.cumsum(0, dtype=torch.int32)), f"rank {r}: {prefix}")


if __name__ == "__main__":
    fabric.main()
