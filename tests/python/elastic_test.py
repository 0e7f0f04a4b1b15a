"""DeepEP 2's ElasticBuffer on the drop-in (`from epfabric import deep_ep`): 4 processes with gloo, each with its own
daemon, on one host and on two (the daemons' host ids: hybrid mode's scale-up domain is a host). What DeepEP 2's
tests/elastic/test_ep.py checks, against references computed with torch from every rank's seeded inputs: received
rows, top-k indices and weights by source token, DeepEP 2's handle fields (recv_src_metadata, prefix sums per scale-up
rank and per expert, aligned counts), cumulative statistics, the expanded layout with aligned and zeroed padding, FP8
with scales (and the TMA-aligned column-major scales), cached dispatch (with new weights), worst-case rows without CPU
sync, and combine bit for bit in DeepEP 2's reduction order with 0, 1 or 2 biases, with and without
allow_multiple_reduction; then the domain sizes, size hints, barrier, events and the calls that refuse."""
import gc
import os
import subprocess
import sys
import tempfile
import unittest

import fabric

N = fabric.RANKS
HIDDEN, TOPK, EXPERTS, MAX_TOKENS = 256, 4, 16, 24


def fp8_bytes(gen, rows, hidden):
    """Random FP8 e4m3 data (no NaN patterns) and float scales, as DeepEP 2's per_token_cast_to_fp8 makes."""
    import torch
    data = torch.randint(0, 0x7F, (rows, hidden), generator=gen, dtype=torch.uint8)
    data |= torch.randint(0, 2, (rows, hidden), generator=gen, dtype=torch.uint8) << 7
    fp8 = getattr(torch, "float8_e4m3fn", None)
    return (data.view(fp8) if fp8 is not None else data), torch.rand(rows, hidden // 128, generator=gen) + 0.5


def as_bytes(t):
    import torch
    return t.view(torch.uint8) if t.element_size() == 1 else t


def expert_output(src, slot, hidden):
    """What expert of top-k slot `slot` returns for global source token `src` (bf16 [len(src), hidden])."""
    import torch
    seed = (src.to(torch.float64) * TOPK + slot + 1) * 0.618
    cols = torch.arange(1, hidden + 1, dtype=torch.float64)
    return torch.sin(seed.unsqueeze(1) * cols * 0.01).to(torch.bfloat16)


def worker(rank, store, hosts):
    fabric.require_torch()
    import torch
    import torch.distributed as dist

    from epfabric import deep_ep

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=N)
    seed = int(os.environ["EPF_TEST_SEED"])
    L, per_host = EXPERTS // N, N // hosts
    ins = []
    for r in range(N):  # every process rebuilds every rank's inputs from the seed
        gen = torch.Generator().manual_seed(seed + r)
        n = MAX_TOKENS - 3 * r
        x = (torch.randn(n, HIDDEN, generator=gen) * 2).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(n)])
        idx[torch.rand(n, TOPK, generator=gen) < 0.2] = -1
        w = torch.rand(n, TOPK, generator=gen).masked_fill(idx < 0, 0)
        ins.append((x, idx, w, fp8_bytes(gen, n, HIDDEN)))
    x, idx, w, (q, s) = ins[rank]
    if fabric.BACKEND == "cuda":
        torch.cuda.set_device(0)

    def dev(*tensors):
        """The tensors on the backend's device, as a tuple."""
        moved = fabric.to_dev(*tensors)
        return moved if len(tensors) > 1 else (moved,)

    # The reference: every token of every rank that chose one of this rank's experts, by global source index.
    lo, hi = rank * L, (rank + 1) * L
    ref = []  # (global index, source rank, x row, local idx row, weight row, fp8 row, scales row)
    for r, (rx, ridx, rw, (rq, rs)) in enumerate(ins):
        here = (ridx >= lo) & (ridx < hi)
        for t in here.any(1).nonzero().flatten().tolist():
            local = torch.where(here[t], ridx[t] - lo, torch.full_like(ridx[t], -1))
            ref.append((r * MAX_TOKENS + t, r, rx[t], local, rw[t], rq[t], rs[t]))
    ref_src = torch.tensor([e[0] for e in ref], dtype=torch.int32)
    ref_idx = torch.stack([e[3] for e in ref])
    counts = [int((ref_idx == e).sum()) for e in range(L)]
    scaleout, scaleup = (hosts, per_host) if hosts > 1 else (1, N)

    def check_handle(h, alignment, expand):
        assert torch.equal(h.recv_src_metadata[:, 0].cpu(), ref_src), "recv_src_metadata[:, 0]"
        first = torch.tensor([int((e[3] >= 0).nonzero()[0]) for e in ref])
        want_col1 = torch.tensor([e[1] for e in ref]) * TOPK + first
        assert torch.equal(h.recv_src_metadata[:, 1].cpu().long(), want_col1), "recv_src_metadata[:, 1]"
        aligned = [-(-c // alignment) * alignment for c in counts]
        assert h.num_recv_tokens_per_expert_list == aligned, (h.num_recv_tokens_per_expert_list, aligned)
        assert h.num_unaligned_recv_tokens_per_expert.cpu().tolist() == counts
        psum = h.psum_num_recv_tokens_per_expert.cpu().tolist()
        want = [sum(aligned[:e]) + (counts[e] if expand else aligned[e]) for e in range(L)]
        assert psum == want, (psum, want)
        per_source = [sum(e[1] == r for e in ref) for r in range(N)]
        per_scaleup = [sum(per_source[i::scaleup]) for i in range(scaleup)]
        got = h.psum_num_recv_tokens_per_scaleup_rank.cpu().tolist()
        assert got == torch.tensor(per_scaleup).cumsum(0).tolist(), (got, per_scaleup)
        assert h.num_recv_tokens == len(ref) and h.topk_idx.shape == (x.shape[0], TOPK)

    def combine_reference(bias, reduce_local, hybrid):
        """DeepEP 2's reference combine of expert_output for this rank's tokens: each rank's slots added in slot
        order (reduce_local), then each host's (hybrid), then every slot in order onto the bias, in float."""
        n = x.shape[0]
        src = rank * MAX_TOKENS + torch.arange(n)
        y = torch.stack([expert_output(src, j, HIDDEN) for j in range(TOPK)], 1)
        y[idx < 0] = 0

        def grouped(values, group):
            out = torch.zeros_like(values)
            for t in range(n):
                for g in set(group[t].tolist()):
                    members = [j for j in range(TOPK) if group[t, j] == g]
                    total = torch.zeros(HIDDEN)
                    for j in members:
                        total += values[t, j].float()
                    out[t, members[-1]] = total.to(torch.bfloat16)
            return out

        if reduce_local:
            y = grouped(y, torch.div(idx, L, rounding_mode="floor"))
        if hybrid:
            y = grouped(y, torch.div(idx, L * per_host, rounding_mode="floor"))
        b0, b1 = bias if isinstance(bias, tuple) else (bias, None)
        result = torch.zeros(n, HIDDEN) if b0 is None else (b0.float() + b1.float() if b1 is not None else b0.float())
        for j in range(TOPK):
            result = result + y[:, j].float()
        return result.to(torch.bfloat16)

    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(dist.group.WORLD, MAX_TOKENS, HIDDEN, TOPK)
    assert hint > 0 and hint % (2 << 20) == 0, hint
    for allow_multiple_reduction in (True, False):
        buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                    num_topk=TOPK, allow_multiple_reduction=allow_multiple_reduction,
                                    explicitly_destroy=True)
        assert buf.num_bytes == hint and (buf.rank_idx, buf.num_ranks) == (rank, N)
        assert buf.get_physical_domain_size() == (hosts, per_host)
        assert buf.get_logical_domain_size() == (scaleout, scaleup)
        assert (buf.scaleout_rank_idx, buf.scaleup_rank_idx) == (rank // scaleup, rank % scaleup)
        num_sms = buf.get_theoretical_num_sms(EXPERTS, TOPK)
        assert num_sms > 0 and buf.get_theoretical_num_qps(num_sms) <= buf.num_allocated_qps
        for alignment, use_fp8, num_bias in ((1, False, 0), (4, True, 1), (8, False, 2)):
            gen = torch.Generator().manual_seed(seed + 100 * alignment + rank)
            bias = tuple((torch.randn(x.shape[0], HIDDEN, generator=gen)).to(torch.bfloat16) for _ in range(num_bias))
            bias = bias[0] if num_bias == 1 else (bias if num_bias == 2 else None)
            data = dev(q, s) if use_fp8 else dev(x)[0]
            data = tuple(data) if use_fp8 else data
            d_idx, d_w = dev(idx, w)
            stats = dev(torch.zeros(L, dtype=torch.int32))[0]
            args = dict(num_experts=EXPERTS, expert_alignment=alignment, num_sms=num_sms)
            recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
                data, topk_idx=d_idx, topk_weights=d_w, cumulative_local_expert_recv_stats=stats,
                previous_event=buf.capture(), async_with_compute_stream=True, **args)
            event.current_stream_wait()
            check_handle(handle, alignment, expand=False)
            assert stats.cpu().tolist() == counts, "cumulative_local_expert_recv_stats"
            assert handle.num_sms == num_sms and handle.expert_alignment == alignment
            if use_fp8:
                assert torch.equal(as_bytes(recv_x[0].cpu()), torch.stack([as_bytes(e[5]) for e in ref]))
                assert torch.equal(recv_x[1].cpu(), torch.stack([e[6] for e in ref]))
            else:
                assert torch.equal(recv_x.cpu(), torch.stack([e[2] for e in ref])), "recv_x"
            assert torch.equal(recv_idx.cpu(), ref_idx), "recv_topk_idx"
            mask = ref_idx >= 0
            assert torch.equal(recv_w.cpu()[mask], torch.stack([e[4] for e in ref])[mask]), "recv_topk_weights"

            # cached: the same rows again (recv_topk_idx too), the handle itself back
            cached_x, cached_idx, cached_w, cached_handle, _ = buf.dispatch(data, handle=handle)
            assert cached_handle is handle and cached_w is None and torch.equal(cached_idx, recv_idx)
            assert torch.equal(as_bytes(cached_x[0] if use_fp8 else cached_x), as_bytes(
                recv_x[0] if use_fp8 else recv_x))

            # expanded, with TMA-aligned column-major scales
            ex_x, ex_idx, ex_w, ex_handle, _ = buf.dispatch(data, topk_idx=d_idx, topk_weights=d_w, do_expand=True,
                                                            use_tma_aligned_col_major_sf=True, **args)
            assert ex_idx is None
            check_handle(ex_handle, alignment, expand=True)
            slots = ex_handle.recv_src_metadata[:, 2:].cpu().long()
            total = sum(-(-c // alignment) * alignment for c in counts)
            rows_x = ex_x[0] if use_fp8 else ex_x
            assert rows_x.shape[0] == total == ex_handle.num_expanded_tokens and ex_w.shape == (total,)
            starts = [sum(-(-c // alignment) * alignment for c in counts[:e]) for e in range(L)]
            for i, e in enumerate(ref):
                for j in range(TOPK):
                    expert = int(e[3][j])
                    if expert < 0:
                        assert slots[i, j] == -1
                        continue
                    k = int(slots[i, j])
                    assert starts[expert] <= k < starts[expert] + counts[expert], (i, j, k)
                    assert float(ex_w[k]) == float(e[4][j])
                    if use_fp8:
                        assert torch.equal(as_bytes(ex_x[0][k].cpu()), as_bytes(e[5]))
                        assert torch.equal(ex_x[1][k].cpu(), e[6])
                    else:
                        assert torch.equal(ex_x[k].cpu(), e[2])
            for expert in range(L):  # alignment rows are zero
                pad = slice(starts[expert] + counts[expert], starts[expert] + -(-counts[expert] // alignment) *
                            alignment)
                assert (rows_x[pad].cpu().float() == 0).all() and (ex_w[pad] == 0).all()
            if use_fp8:
                rows = ex_x[1].shape[0]
                assert ex_x[1].stride() == (1, -(-rows // 4) * 4), ex_x[1].stride()
            # cached expanded with new weights: the same slots, the new weights
            new_w = dev(torch.rand(x.shape[0], TOPK, generator=gen).masked_fill(idx < 0, 0))[0]
            cx, _, cw, _, _ = buf.dispatch(data, topk_weights=new_w, handle=ex_handle, do_expand=True,
                                           use_tma_aligned_col_major_sf=True)
            assert torch.equal(as_bytes((cx[0] if use_fp8 else cx).cpu()), as_bytes(rows_x.cpu()))
            want_w = torch.zeros(total)
            gathered = [None] * N
            dist.all_gather_object(gathered, new_w.cpu())
            for i, e in enumerate(ref):
                src_rank, t = divmod(e[0], MAX_TOKENS)
                for j in range(TOPK):
                    if slots[i, j] >= 0:
                        want_w[slots[i, j]] = gathered[src_rank][t, j]
            assert torch.equal(cw.cpu(), want_w), "cached expanded weights"

            # combine, non-expanded: each row is its rank's sum over its local slots
            src = ref_src.long()
            local_y = torch.zeros(len(ref), HIDDEN)
            for j in range(TOPK):
                here = ref_idx[:, j] >= 0
                local_y[here] += expert_output(src[here], j, HIDDEN).float()
            combined, combined_w, event = buf.combine(dev(local_y.to(torch.bfloat16))[0], handle,
                                                      topk_weights=recv_w, bias=dev_bias(bias, dev))
            hybrid = hosts > 1 and allow_multiple_reduction
            assert torch.equal(combined.cpu(), combine_reference(bias, True, hybrid)), "combined_x (non-expanded)"
            assert torch.equal(combined_w.cpu(), w), "combined_topk_weights"
            # combine, expanded: every entry's own expert output
            ex_in = torch.zeros(total, HIDDEN, dtype=torch.bfloat16)
            for j in range(TOPK):
                here = slots[:, j] >= 0
                ex_in[slots[here, j]] = expert_output(src[here], j, HIDDEN)
            combined, combined_w, _ = buf.combine(dev(ex_in)[0], ex_handle, topk_weights=ex_w,
                                                  bias=dev_bias(bias, dev))
            want = combine_reference(bias, allow_multiple_reduction, hybrid)
            assert torch.equal(combined.cpu(), want), f"combined_x (expanded, {allow_multiple_reduction=})"
            assert torch.equal(combined_w.cpu(), w), "combined_topk_weights (expanded)"

        # without CPU sync: DeepEP 2's worst-case rows, padding rows -1 in the metadata
        recv_x, recv_idx, _, handle, _ = buf.dispatch(dev(x)[0], topk_idx=dev(idx)[0], num_experts=EXPERTS,
                                                      do_cpu_sync=False)
        assert recv_x.shape[0] == N * MAX_TOKENS and handle.num_recv_tokens_per_expert_list == []
        n = len(ref)
        assert torch.equal(recv_x[:n].cpu(), torch.stack([e[2] for e in ref]))
        assert (handle.recv_src_metadata[n:, 0] == -1).all() and (recv_idx[n:] == -1).all()
        assert int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == n

        for call, params in (("pp_send", (x, 0)), ("all_gather", (x,)), ("engram_write", (x,)),
                             ("create_agrs_session", ())):
            try:
                getattr(buf, call)(*params)
                raise AssertionError(f"{call} was not refused")
            except NotImplementedError as error:
                assert call in str(error), error
        buf.barrier()
        buf.destroy()
        # The Buffer's memory may go now (a collection may run at any point): the handles of its calls, still held
        # here until the next round replaces them, must not need it (they keep its allocator's callbacks).
        gc.collect()
        try:
            buf.dispatch(dev(x)[0], topk_idx=dev(idx)[0], num_experts=EXPERTS)
            raise AssertionError("a destroyed ElasticBuffer was usable")
        except RuntimeError as error:
            assert "destroyed" in str(error), error

    assert deep_ep.get_physical_domain_size(dist.group.WORLD) == (hosts, per_host)
    assert deep_ep.get_logical_domain_size(dist.group.WORLD) == (scaleout, scaleup)
    assert deep_ep.get_logical_domain_size(dist.group.WORLD, allow_hybrid_mode=False) == (1, N)
    try:
        deep_ep.ElasticBuffer(dist.group.WORLD, num_bytes=hint, num_cpu_bytes=2 << 20)
        raise AssertionError("num_cpu_bytes was not refused")
    except NotImplementedError as error:
        assert "Engram" in str(error), error
    implicit = deep_ep.ElasticBuffer(dist.group.WORLD, num_bytes=hint, num_max_tokens_per_rank=MAX_TOKENS)
    try:
        implicit.destroy()
        raise AssertionError("destroy without explicitly_destroy was not refused")
    except RuntimeError as error:
        assert "explicitly_destroy" in str(error), error
    implicit.runtime.destroy()
    dist.destroy_process_group()
    print(f"rank {rank}: OK", flush=True)


def dev_bias(bias, dev):
    if bias is None:
        return None
    return tuple(dev(*bias)) if isinstance(bias, tuple) else dev(bias)[0]


class ElasticBufferTest(unittest.TestCase):
    def test_one_host(self):
        self.run_processes(hosts=1)

    def test_two_hosts(self):
        """Hybrid mode's scale-up domain is a host: the per-scale-up-rank counts and combine's order follow it."""
        self.run_processes(hosts=2)

    def test_event_overlap_of_deep_ep_2(self):
        """DeepEP 2's EventOverlap: a hook registered after the wait runs once, at the wait; release_handle drops
        the event; `with event(release_handle=True)` does both on exit."""
        fabric.require_torch()
        from epfabric import deep_ep
        ran = []
        event = deep_ep.EventOverlap(deep_ep.EventHandle())
        event.register_hook_after_wait(lambda: ran.append(1))
        with self.assertRaises(RuntimeError):
            event.register_hook_after_wait(lambda: None)
        with event(release_handle=True):
            pass
        self.assertEqual(ran, [1])
        self.assertIsNone(event.event)
        event.current_stream_wait()
        self.assertEqual(ran, [1], "the hook runs once")

    def run_processes(self, hosts):
        seed = os.environ.get("EPF_TEST_SEED", str(int.from_bytes(os.urandom(3), "little")))
        print(f"seed {seed}, {hosts} host(s)", flush=True)
        with fabric.Fabric(N, hosts=hosts) as fab, tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, EPFABRIC_SOCKET=str(fab.dir / "d{local_rank}.sock"), EPF_TEST_SEED=seed,
                       PYTHONFAULTHANDLER="1", PYTHONMALLOC="debug",  # a freed Python object read fails loudly
                       PYTHONPATH=os.pathsep.join([str(fabric.ROOT / "python"), str(fabric.ROOT / "tests" / "python")]))
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), f"{tmp}/store", str(hosts)],
                                      env=dict(env, LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for r in range(N)]
            outputs = []
            for r, p in enumerate(procs):
                try:
                    out, _ = p.communicate(timeout=240)
                except subprocess.TimeoutExpired:
                    for q in procs:
                        q.kill()
                    self.fail(f"rank {r} did not finish within 240 s")
                outputs.append(out)
            failed = [f"rank {r} failed (exit status {p.returncode}):\n{outputs[r]}" for r, p in enumerate(procs)
                      if p.returncode != 0]
            if failed:  # every failed rank's whole output: the first failure is often another rank's consequence
                self.fail("\n".join(failed))
            for r in range(N):
                self.assertIn(f"rank {r}: OK", outputs[r])
            self.assertNotIn("deep_ep-", fab.epctl_run(0, "groups"), "rank 0 deletes the groups it created")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        fabric.main()
