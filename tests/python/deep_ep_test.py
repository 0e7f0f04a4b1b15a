"""The drop-in: `from epfabric import deep_ep`, deep_ep.Buffer(group, ...) over a torch.distributed process group
(gloo, file store) in 4 processes, each with its own daemon through EPFABRIC_SOCKET's {local_rank} template, on one
host or two (the daemons' host ids). Normal and low-latency rounds, and both alternating on one low_latency_mode Buffer
(SGLang's auto mode), checked against references; on cuda across hosts also a low-latency dispatch + combine and a
worst-case normal layout + dispatch + combine captured into CUDA graphs and replayed; the groups rank 0 created are
gone afterwards."""
import os
import subprocess
import sys
import tempfile
import unittest

import fabric

N = fabric.RANKS
HIDDEN, TOPK, EXPERTS, TOKENS = 256, 4, 16, 24


def worker(rank, store, hosts):
    fabric.require_torch()
    import torch
    import torch.distributed as dist

    from epfabric import deep_ep

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=N)
    seed = int(os.environ["EPF_TEST_SEED"])
    ins = []
    for r in range(N):  # every process rebuilds every rank's inputs from the seed
        gen = torch.Generator().manual_seed(seed + r)
        x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(TOKENS)])
        idx[torch.rand(TOKENS, TOPK, generator=gen) < 0.2] = -1
        ins.append((x, idx, torch.rand(TOKENS, TOPK, generator=gen)))
    x, idx, w = ins[rank]
    L = EXPERTS // N
    if fabric.BACKEND == "cuda":  # the ranks share GPU 0 (the device machine has one)
        torch.cuda.set_device(0)
    dx, didx, dw = fabric.to_dev(x, idx, w)

    def normal_round(buf):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(didx, EXPERTS)
        recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
            dx, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=didx, topk_weights=dw, async_finish=fabric.BACKEND == "cuda")
        event.current_stream_wait()
        combined, _, _ = buf.combine(recv_x, handle)
        recv_x, combined = recv_x.cpu(), combined.cpu()
        # Received order: by source rank, then token, as DeepEP's (across hosts the library's order is permuted into it)
        want = torch.cat([ins[s][0][((ins[s][1] >= rank * L) & (ins[s][1] < (rank + 1) * L)).any(1)] for s in range(N)])
        assert torch.equal(recv_x, want), f"rank {rank}: recv_x"
        assert counts == [sum(int((ids == rank * L + e).sum()) for _, ids, _ in ins) for e in range(L)], counts
        ranks = torch.stack([((idx >= d * L) & (idx < (d + 1) * L)).any(1) for d in range(N)], 1).sum(1, keepdim=True)
        torch.testing.assert_close(combined.float(), x.float() * ranks, rtol=2 ** -7, atol=1e-2)

    def shapes_round(buf):
        """DeepEP's test_intranode order on a new Buffer: a dispatch without top-k (the C Buffer is set up for top-1;
        with top-k across hosts), then one with top-k and twice the hidden size: every rank replaces its C Buffer at
        that call; the first handle is then refused by combine. DeepEP's handle fields: rank_prefix_matrix equals the
        one computed by hand, and the received rows come by source rank as it says; is_token_in_rank is the dispatch's;
        the rest say that they are not available."""
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(didx, EXPERTS)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        # (across hosts a dispatch needs top-k: the gateways route by it)
        recv_x, _, _, _, first, _ = buf.dispatch(dx, **layout, **({} if hosts == 1 else dict(topk_idx=didx)))
        assert buf._cfg["hidden"] == HIDDEN and buf._cfg["topk"] == (1 if hosts == 1 else TOPK), buf._cfg
        cached_x = buf.dispatch(dx, handle=first)[0]
        assert torch.equal(cached_x.cpu(), recv_x.cpu())
        wide, wide_w = torch.cat([dx, -dx], 1), torch.cat([x, -x], 1)
        recv_wide, recv_idx, _, counts, handle, _ = buf.dispatch(wide, **layout, topk_idx=didx, topk_weights=dw)
        assert (buf._cfg["hidden"], buf._cfg["topk"]) == (2 * HIDDEN, TOPK), buf._cfg
        assert counts == [sum(int((ids == rank * L + e).sum()) for _, ids, _ in ins) for e in range(L)], counts
        try:
            buf.combine(recv_x, first)
            raise AssertionError("a handle from before the C Buffer was replaced was not refused")
        except ValueError as error:
            assert "dispatch again" in str(error), error
        ranks = torch.stack([((idx >= d * L) & (idx < (d + 1) * L)).any(1) for d in range(N)], 1).sum(1, keepdim=True)
        combined = buf.combine(recv_wide, handle)[0].cpu()
        torch.testing.assert_close(combined.float(), wide_w.float() * ranks, rtol=2 ** -7, atol=1e-2)
        sent = torch.stack([torch.stack([((ids >= d * L) & (ids < (d + 1) * L)).any(1).sum() for d in range(N)])
                            for _, ids, _ in ins]).to(torch.int32)
        if hosts > 1:
            # DeepEP's internode handle: is_token_in_rank first, recv_gbl_rank_prefix_sum at [-4] (rows from ranks
            # 0..i, by which DeepEP's test_internode checks the rows: rank i's end there); the layout's per-host counts
            assert handle[0] is in_rank and len(handle) == 10
            prefix = handle[-4].cpu()
            assert torch.equal(prefix, sent[:, rank].cumsum(0, dtype=torch.int32)), f"rank {rank}: {prefix}"
            start = 0
            for source in range(N):
                end = int(prefix[source])
                rows = ((ins[source][1] >= rank * L) & (ins[source][1] < (rank + 1) * L)).any(1)
                assert torch.equal(recv_wide[start:end, :HIDDEN].cpu(), ins[source][0][rows]), f"rank {rank}: {source}"
                start = end
            per_host = N // hosts
            on_host = in_rank.cpu().view(-1, hosts, per_host).any(2).sum(0, dtype=torch.int32)
            assert torch.equal(buf.get_dispatch_layout(didx, EXPERTS)[1].cpu(), on_host)
            return
        assert buf.get_dispatch_layout(didx, EXPERTS)[1] is None
        assert handle[4] is in_rank and len(handle) == 6
        want = sent.cumsum(0, dtype=torch.int32)  # [i][j]: tokens ranks 0..i send to rank j
        got = handle[0].cpu()
        assert got.dtype == torch.int32 and torch.equal(got, want), f"rank {rank}: {got} != {want}"
        start = 0
        for source in range(N):  # DeepEP's check_data: source i's rows end at rank_prefix_matrix[i][rank]
            end = int(got[source][rank])
            rows = ((ins[source][1] >= rank * L) & (ins[source][1] < (rank + 1) * L)).any(1)
            assert torch.equal(recv_wide[start:end, :HIDDEN].cpu(), ins[source][0][rows]), f"rank {rank}: {source}"
            start = end
        for i in (1, 2, 3, 5):
            assert isinstance(handle[i], deep_ep.UnavailableField), handle[i]
            try:
                handle[i][0]
                raise AssertionError(f"handle[{i}] was usable")
            except NotImplementedError as error:
                assert handle[i].name in str(error), error

    M = TOKENS

    def low_latency_round(ll, M=M):
        recv, count, handle, _, hook = ll.low_latency_dispatch(dx, didx, M, EXPERTS, use_fp8=False)
        assert hook is None
        combined = ll.low_latency_combine(recv, didx, dw, handle)[0].cpu()
        count = count.cpu()
        for le in range(L):
            want_n = sum(int((ids == rank * L + le).any(1).sum()) for _, ids, _ in ins)
            assert int(count[le]) == want_n, f"rank {rank} expert {le}: {int(count[le])} != {want_n}"
        weight = torch.where(idx >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
        torch.testing.assert_close(combined.float(), x.float() * weight, rtol=2 ** -7, atol=1e-2)

    if hosts > 1:
        # Across hosts (the daemons' host ids, not DeepEP's 8 GPUs per host): normal mode needs DeepEP's RDMA size.
        try:
            deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20)
            raise AssertionError("a normal-mode Buffer across hosts without num_rdma_bytes was not refused")
        except RuntimeError as error:
            assert "num_rdma_bytes" in str(error) and f"{hosts} hosts" in str(error), error
        buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, num_rdma_bytes=64 << 20,
                             explicitly_destroy=True)
        assert buf.num_nvl_ranks == N // hosts, buf.num_nvl_ranks
    else:
        buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, explicitly_destroy=True)
    shapes_round(buf)
    normal_round(buf)  # a smaller hidden size on the replaced C Buffer
    assert buf._cfg["hidden"] == 2 * HIDDEN, buf._cfg
    buf.destroy()

    class Comm:
        """An mpi4py-like communicator (DeepEP's `comm`, used when group is None) over the gloo process group."""

        def Get_rank(self):
            return rank

        def Get_size(self):
            return N

        def allgather(self, obj):
            out = [None] * N
            dist.all_gather_object(out, obj)
            return out

        def bcast(self, obj, root=0):
            box = [obj]
            dist.broadcast_object_list(box, src=root)
            return box[0]

        def Barrier(self):
            dist.barrier()

    # Every keyword of DeepEP's V1 lines (those without an effect here are accepted), over an mpi4py-like comm
    with_comm = deep_ep.Buffer(None, num_nvl_bytes=8 << 20, num_rdma_bytes=8 << 20 if hosts > 1 else 0,
                               low_latency_mode=False, num_qps_per_rank=8, allow_nvlink_for_low_latency_mode=False,
                               allow_mnnvl=True, use_fabric=True, explicitly_destroy=True, enable_shrink=False,
                               comm=Comm())
    assert with_comm.group_size == N and with_comm.rank == rank
    normal_round(with_comm)
    with_comm.destroy()

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, N, EXPERTS)
    roomy = deep_ep.Buffer.get_low_latency_rdma_size_hint(2 * M, HIDDEN, N, EXPERTS)  # room for two shapes
    ll = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=roomy, low_latency_mode=True, explicitly_destroy=True)
    low_latency_round(ll)
    first = ll.low_latency_dispatch(dx, didx, M, EXPERTS, use_fp8=False)[2]
    # Another num_max_dispatch_tokens_per_rank that fits the group: every rank replaces its low-latency C Buffer at this
    # call
    low_latency_round(ll, M=2 * M)
    assert ll._ll_cfg["max_tokens"] == 2 * M, ll._ll_cfg
    try:
        ll.low_latency_combine(torch.zeros(L, N * M, HIDDEN, dtype=torch.bfloat16, device=dx.device), didx, dw, first)
        raise AssertionError("a low-latency handle from before the C Buffer was replaced was not refused")
    except ValueError as error:
        assert "dispatch again" in str(error), error
    try:  # one that does not fit the group's memory: refused with the bytes, before anything is replaced
        ll.low_latency_dispatch(dx, didx, 64 * M, EXPERTS, use_fp8=False)
        raise AssertionError("a low-latency call too large for the group was not refused")
    except ValueError as error:
        assert "bytes per rank; the group has" in str(error), error
    low_latency_round(ll, M=2 * M)
    try:
        ll.dispatch(dx, num_tokens_per_rank=torch.zeros(N, dtype=torch.int32))
        raise AssertionError("normal dispatch on a low-latency-only buffer was not refused")
    except RuntimeError as error:
        assert "without a normal-mode part" in str(error), error
    ll.destroy()

    if fabric.BACKEND == "cuda" and hosts > 1:
        # Decode from CUDA graphs across hosts: the puts issued from the device (decision 84; on the socket wire the
        # default relays from the calling thread, which cannot be captured). Captured once, replayed with new inputs.
        # The library's Buffer is made at the first call, which reads the variable.
        os.environ["EPF_LOW_LATENCY_ISSUE"] = "device"
        graphed = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
        low_latency_round(graphed)  # an eager call first, as DeepEP's callers do before capturing
        del os.environ["EPF_LOW_LATENCY_ISSUE"]
        static_x = dx.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv, _, handle, _, _ = graphed.low_latency_dispatch(static_x, didx, M, EXPERTS, use_fp8=False)
            static_out = graphed.low_latency_combine(recv, didx, dw, handle)[0]
        weight = torch.where(idx >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
        for sign in (-1.0, 1.0):  # every rank replays with its rows negated, then as they were
            static_x.copy_(dx * sign)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(static_out.float().cpu(), x.float() * sign * weight, rtol=2 ** -7, atol=1e-2)
        del graph
        graphed.destroy()

        # Prefill from CUDA graphs across hosts: in worst-case mode (num_worst_tokens) normal mode's RDMA stage puts
        # and waits on the device, so the layout, the dispatch and the combine are captured together and replayed.
        prefill = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, num_rdma_bytes=64 << 20,
                                 explicitly_destroy=True)
        worst = N * TOKENS

        def worst_case_calls(x_in):
            per_rank, _, per_expert, in_rank, _ = prefill.get_dispatch_layout(didx, EXPERTS)
            recv_x, _, _, _, handle, _ = prefill.dispatch(
                x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=didx, topk_weights=dw, num_worst_tokens=worst)
            return recv_x, prefill.combine(recv_x, handle)[0]

        worst_case_calls(dx)  # eager first
        static_x = dx.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_recv, static_out = worst_case_calls(static_x)
        want = torch.cat([ins[s][0][((ins[s][1] >= rank * L) & (ins[s][1] < (rank + 1) * L)).any(1)] for s in range(N)])
        ranks = torch.stack([((idx >= d * L) & (idx < (d + 1) * L)).any(1) for d in range(N)], 1).sum(1, keepdim=True)
        for sign in (-1.0, 1.0):  # replayed with every rank's rows negated, then as they were
            static_x.copy_(dx * sign)
            graph.replay()
            torch.cuda.synchronize()
            assert static_recv.shape[0] == worst, static_recv.shape
            assert torch.equal(static_recv[:want.shape[0]].cpu(), want * sign), f"rank {rank}: graphed recv_x"
            torch.testing.assert_close(static_out.float().cpu(), x.float() * sign * ranks, rtol=2 ** -7, atol=1e-2)
        del graph
        prefill.destroy()

    # SGLang's auto mode: one low_latency_mode Buffer with both sizes alternates prefill (normal) and decode. Across
    # hosts DeepEP's callers pass the larger of the two modes' RDMA sizes; the RDMA region is split as the NVL one.
    rdma = max(hint, 64 << 20) if hosts > 1 else hint
    auto = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=16 << 20, num_rdma_bytes=rdma, low_latency_mode=True,
                          explicitly_destroy=True)
    assert auto.num_normal_bytes == 16 << 20 and auto.normal_mode
    assert auto.num_normal_rdma_bytes == (rdma if hosts > 1 else 0), auto.num_normal_rdma_bytes
    for _ in range(2):
        normal_round(auto)
        low_latency_round(auto)
    auto.destroy()
    dist.destroy_process_group()
    print(f"rank {rank}: OK", flush=True)


class DeepEpDropInTest(unittest.TestCase):
    def test_four_processes_with_gloo(self):
        self.run_processes(hosts=1)

    def test_two_hosts_of_two_processes(self):
        """The group spans the daemons' two host ids: rank 0 sizes it for the internode paths."""
        self.run_processes(hosts=2)

    def run_processes(self, hosts):
        seed = os.environ.get("EPF_TEST_SEED", str(int.from_bytes(os.urandom(3), "little")))
        print(f"seed {seed}, {hosts} host(s)", flush=True)
        with fabric.Fabric(N, hosts=hosts) as fab, tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, EPFABRIC_SOCKET=str(fab.dir / "d{local_rank}.sock"), EPF_TEST_SEED=seed,
                       PYTHONPATH=os.pathsep.join([str(fabric.ROOT / "python"), str(fabric.ROOT / "tests" / "python")]))
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), f"{tmp}/store", str(hosts)],
                                      env=dict(env, LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for r in range(N)]
            outputs = []
            for r, p in enumerate(procs):
                try:
                    out, _ = p.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    for q in procs:
                        q.kill()
                    self.fail(f"rank {r} did not finish within 120 s")
                outputs.append(out)
            for r, p in enumerate(procs):
                self.assertEqual(p.returncode, 0, f"rank {r} failed:\n{outputs[r]}")
                self.assertIn(f"rank {r}: OK", outputs[r])
            groups = fab.epctl_run(0, "groups")
            self.assertNotIn("deep_ep-", groups, "rank 0 deletes the groups it created")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        fabric.main()
