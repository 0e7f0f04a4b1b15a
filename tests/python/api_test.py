"""epfabric's Python API around the data path: bad input is a Python exception with a clear message and nothing is
launched (the next valid call of every rank still works), mode mismatches, the local buffer tensor, size hints,
errors from the daemon, and that epfabric.deep_ep.Buffer has DeepEP's method names and parameters."""
import inspect
import unittest

import fabric

fabric.require_torch()
import torch  # noqa: E402

import epfabric  # noqa: E402
from epfabric import deep_ep  # noqa: E402

N = 2
HIDDEN, TOPK, EXPERTS = 256, 2, 8

# DeepEP's Buffer (v1.2.x / main) as inference servers call it: method -> parameters in order.
DEEP_EP_METHODS = {
    "__init__": ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                 "allow_nvlink_for_low_latency_mode", "allow_mnnvl"],
    "get_dispatch_layout": ["topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream"],
    "dispatch": ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                 "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens", "config",
                 "previous_event", "async_finish", "allocate_on_comm_stream"],
    "combine": ["x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
                "allocate_on_comm_stream"],
    "low_latency_dispatch": ["x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                             "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8",
                             "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"],
    "low_latency_combine": ["x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy", "async_finish",
                            "return_recv_hook", "out", "combine_wait_recv_cost_stats"],
    "get_next_low_latency_combine_buffer": ["handle"],
    "clean_low_latency_buffer": ["num_max_dispatch_tokens_per_rank", "hidden", "num_experts"],
    "get_local_buffer_tensor": ["dtype", "size", "offset", "use_rdma_buffer"],
    "get_comm_stream": [],
    "low_latency_update_mask_buffer": ["rank_to_mask", "mask"],
    "low_latency_query_mask_buffer": ["mask_status"],
    "low_latency_clean_mask_buffer": [],
    "destroy": [],
}
DEEP_EP_STATIC = {
    "set_num_sms": ["new_num_sms"],
    "capture": [],
    "get_low_latency_rdma_size_hint": ["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"],
    "get_dispatch_config": ["num_ranks"],
    "get_combine_config": ["num_ranks"],
    "is_sm90_compiled": [],
}


class SignatureTest(unittest.TestCase):
    def test_deep_ep_buffer_has_deep_eps_methods_and_parameters(self):
        for name, params in list(DEEP_EP_METHODS.items()) + list(DEEP_EP_STATIC.items()):
            with self.subTest(method=name):
                fn = getattr(deep_ep.Buffer, name)
                got = [p for p in inspect.signature(fn).parameters if p != "self"]
                self.assertEqual(got[:len(params)], params, f"deep_ep.Buffer.{name}")
                if name in DEEP_EP_STATIC:
                    self.assertIsInstance(inspect.getattr_static(deep_ep.Buffer, name), staticmethod, name)
        for name in ("EventOverlap", "Config", "Buffer"):
            self.assertTrue(hasattr(deep_ep, name), name)
        self.assertTrue(hasattr(deep_ep.EventOverlap(), "current_stream_wait"))

    def test_deep_ep_module_names(self):
        """The module-level names DeepEP's tests use: topk_idx_t (int64, as DeepEP's), __version__ (DeepEP's version
        marked as epfabric's), and Buffer.is_sm90_compiled() (True: the FP8 paths exist on every backend)."""
        self.assertIs(deep_ep.topk_idx_t, torch.int64)
        self.assertIsInstance(deep_ep.__version__, str)
        self.assertRegex(deep_ep.__version__, r"^1\.2\.1\+epfabric")
        self.assertIs(deep_ep.Buffer.is_sm90_compiled(), True)
        self.assertIs(epfabric.Buffer.is_sm90_compiled(), True)
        for name in ("topk_idx_t", "__version__"):
            self.assertIn(name, deep_ep.__all__)


class GroupShapeTest(unittest.TestCase):
    """How the drop-in sizes a group from DeepEP's byte counts and the daemons' host ids (no daemon needed)."""

    def test_hosts_come_from_host_ids_in_host_major_order(self):
        self.assertEqual(deep_ep._num_hosts(["a", "a", "a", "a"]), 1)
        self.assertEqual(deep_ep._num_hosts(["a", "a", "b", "b"]), 2)
        for bad in (["a", "b", "a", "b"], ["a", "a", "a", "b"]):
            with self.assertRaisesRegex(ValueError, "host-major"):
                deep_ep._num_hosts(bad)

    def test_sizes_per_mode_and_host_count(self):
        mib = 1 << 20
        self.assertEqual(deep_ep._group_bytes(64 * mib, 0, False, 4, 1), (64 * mib, 0, 0, 0))
        self.assertEqual(deep_ep._group_bytes(0, 3 * mib, True, 4, 1), (3 * mib, 0, 0, 0))
        self.assertEqual(deep_ep._group_bytes(64 * mib, 3 * mib, True, 4, 1), (67 * mib, 0, 64 * mib, 0))
        self.assertEqual(deep_ep._group_bytes(64 * mib, 32 * mib, False, 4, 2), (64 * mib, 32 * mib, 0, 0))
        with self.assertRaisesRegex(ValueError, "num_rdma_bytes"):
            deep_ep._group_bytes(64 * mib, 0, False, 4, 2)
        # Low latency across hosts: the layout in NVL, an inbox and an outbox per rank in RDMA; exact for a size from
        # the hint, else a bound that holds for every shape (checked here up to 256 ranks and down to one token).
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 4, 288)
        exact = epfabric.required_group_bytes(128, 7168, 9, 288, True, 2, 2)
        self.assertEqual(deep_ep._group_bytes(0, hint, True, 4, 2), (exact[0], exact[1], 0, 0))
        self.assertEqual(exact[0], hint)
        for tokens, hidden, hosts, per_host in ((128, 7168, 2, 2), (128, 7168, 2, 8), (128, 7168, 8, 8),
                                                (1, 128, 8, 8), (256, 4096, 4, 4), (128, 7168, 18, 8),
                                                (1, 128, 32, 8)):
            ranks = hosts * per_host
            experts = -(-256 // ranks) * ranks  # a multiple of the ranks
            hinted = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, ranks, experts)
            rdma = epfabric.required_group_bytes(tokens, hidden, 9, experts, True, hosts, per_host)[1]
            self.assertLessEqual(rdma, 2 * hinted + 4096 * ranks, (tokens, hidden, ranks))
        with self.assertWarnsRegex(RuntimeWarning, "upper bound"):
            self.assertEqual(deep_ep._group_bytes(0, 3 * mib, True, 4, 2), (3 * mib, 6 * mib + 4 * 4096, 0, 0))
        # Both sizes across hosts (SGLang's auto mode): normal-mode parts of the two sizes (rounded up to 4096),
        # then low latency's, exact when a hint of this many ranks fits in the RDMA size (DeepEP's callers pass the
        # larger of the two modes' sizes), else the bound with a warning.
        normal = 64 * mib + 100
        aligned = 64 * mib + 4096
        for rdma in (hint, hint + 5 * mib + 1):
            rounded = -(-rdma // 4096) * 4096
            self.assertEqual(deep_ep._group_bytes(normal, rdma, True, 4, 2),
                             (aligned + exact[0], rounded + exact[1], aligned, rounded))
        with self.assertWarnsRegex(RuntimeWarning, "upper bound"):
            self.assertEqual(deep_ep._group_bytes(64 * mib, 3 * mib, True, 8, 2),
                             (67 * mib, 3 * mib + 6 * mib + 8 * 4096, 64 * mib, 3 * mib))


class ApiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.fabric = fabric.Fabric(N).__enter__()
        cls.client = epfabric.Client(cls.fabric.sockets[0])
        nvl, _ = epfabric.required_group_bytes(32, HIDDEN, TOPK, EXPERTS, False, 1, N)
        cls.token = cls.client.create_group("api-normal", [0, 1], nvl, 0, False)
        cls.bufs = fabric.run_ranks(N, lambda r: epfabric.Buffer.attach(cls.fabric.sockets[r], "api-normal", r,
                                                                        cls.token))

    @classmethod
    def tearDownClass(cls):
        for b in cls.bufs:
            b.destroy()
        cls.client.delete_group("api-normal", cls.token)
        cls.client.close()
        cls.fabric.stop()

    def valid_round(self, num_tokens=8):
        """A full dispatch + combine on every rank; returns rank 0's combined_x and x."""
        def rank(r):
            gen = torch.Generator().manual_seed(r)
            x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(num_tokens)])
            x, idx = fabric.to_dev(x, idx)
            b = self.bufs[r]
            per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, EXPERTS)
            recv_x, _, _, _, handle, _ = b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                    num_tokens_per_expert=per_expert, topk_idx=idx)
            combined, _, _ = b.combine(recv_x, handle)
            return x, idx, combined

        for r, (x, idx, combined) in enumerate(fabric.run_ranks(N, rank)):
            ranks = torch.stack([((idx >= d * EXPERTS // N) & (idx < (d + 1) * EXPERTS // N)).any(1)
                                 for d in range(N)], 1).sum(1, keepdim=True)
            torch.testing.assert_close(combined.float(), x.float() * ranks, rtol=2 ** -7, atol=1e-2)

    def test_bad_input_is_refused_before_launch(self):
        self.valid_round()  # sets the Buffer up (hidden, top-k, experts)
        b = self.bufs[0]
        dev = b.device
        x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16, device=dev)
        idx = torch.zeros(4, TOPK, dtype=torch.int64, device=dev)
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, EXPERTS)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        cases = [
            ("x.dtype", TypeError, lambda: b.dispatch(x.float(), **layout, topk_idx=idx)),
            ("not contiguous", ValueError,
             lambda: b.dispatch(torch.zeros(HIDDEN, 4, dtype=torch.bfloat16, device=dev).t(), **layout, topk_idx=idx)),
            ("dimensions", ValueError, lambda: b.dispatch(x[0], **layout, topk_idx=idx)),
            ("topk_idx.dtype", TypeError, lambda: b.dispatch(x, **layout, topk_idx=idx.int())),
            ("required unless handle", ValueError, lambda: b.dispatch(x, topk_idx=idx)),
            ("torch.Tensor", TypeError, lambda: b.dispatch([1, 2], **layout, topk_idx=idx)),
            ("hidden = ", ValueError, lambda: b.dispatch(torch.zeros(4, 2 * HIDDEN, dtype=torch.bfloat16, device=dev),
                                                         **layout, topk_idx=idx)),
            ("INVALID_ARGUMENT", epfabric.EpfError,
             lambda: b.dispatch(torch.zeros(3, HIDDEN, dtype=torch.bfloat16, device=dev), **layout, topk_idx=idx)),
            ("DispatchHandle", TypeError, lambda: b.combine(x, ("not", "a", "handle"))),
            ("created in normal mode", RuntimeError, lambda: b.low_latency_dispatch(x, idx, 8, EXPERTS)),
        ]
        for needle, kind, fn in cases:
            with self.subTest(needle):
                with self.assertRaises(kind) as caught:
                    fn()
                self.assertIn(needle, str(caught.exception))
        bad = idx + 100  # experts out of range: the host layout refuses them, the cuda dispatch before notify
        with self.assertRaises(epfabric.EpfError) as caught:
            per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(bad, EXPERTS)
            b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=bad)
        self.assertEqual(caught.exception.code_name, "INVALID_ARGUMENT")
        self.valid_round()  # nothing was launched: every rank's next call works

    def test_low_latency_issue_is_a_buffer_option(self):
        """Who puts low latency's bytes across hosts is a Buffer option (epf_buffer_options): a value outside the three
        is a ValueError; "device" on the host backend is refused when the low-latency Buffer is made (at its first
        call), with the reason; "relay" and "auto" are taken."""
        with self.assertRaisesRegex(ValueError, "low_latency_issue='bogus'"):
            epfabric.Buffer.attach(self.fabric.sockets[0], "api-normal", 0, self.token, low_latency_issue="bogus")
        if fabric.BACKEND != "host":
            self.skipTest("the refusal of device issue is the host backend's")
        with fabric.Fabric(2, hosts=2) as fab:
            client = epfabric.Client(fab.sockets[0])
            nvl, rdma = epfabric.required_group_bytes(8, HIDDEN, TOPK, EXPERTS, True, 2, 1)
            token = client.create_group("api-ll-issue", [0, 1], nvl, rdma, True)
            for issue, refused in (("device", True), ("relay", False), ("auto", False)):
                with self.subTest(issue):
                    b = epfabric.Buffer.attach(fab.sockets[0], "api-ll-issue", 0, token, low_latency_issue=issue)
                    try:
                        if refused:
                            with self.assertRaises(epfabric.EpfError) as caught:
                                b._ensure_low_latency(8, HIDDEN, TOPK, EXPERTS)
                            self.assertEqual(caught.exception.code_name, "INVALID_ARGUMENT")
                            self.assertIn("needs a cuda group", str(caught.exception))
                        else:
                            b._ensure_low_latency(8, HIDDEN, TOPK, EXPERTS)  # made; no call goes out
                    finally:
                        b.destroy()
            client.delete_group("api-ll-issue", token)
            client.close()

    def test_local_buffer_tensor_and_hints(self):
        b = self.bufs[1]
        t = b.get_local_buffer_tensor(torch.int32, size=(4, 4), offset=64)
        self.assertEqual(tuple(t.shape), (4, 4))
        self.assertEqual(b.get_local_buffer_tensor(torch.uint8).numel(), b.num_nvl_bytes)
        with self.assertRaises(ValueError):
            b.get_local_buffer_tensor(torch.uint8, size=(b.num_nvl_bytes + 1,))
        with self.assertRaises(epfabric.EpfError) as caught:
            b.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        self.assertIn("no RDMA region", str(caught.exception))
        hint = epfabric.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288)
        self.assertEqual(hint, epfabric.required_group_bytes(128, 7168, 9, 288, True, 1, 8)[0])
        self.assertGreater(hint, 128 * 7168)
        self.assertEqual(epfabric.Buffer.get_dispatch_config(8).num_sms, epfabric.Buffer.num_sms)
        self.assertTrue(epfabric.version())

    def test_daemon_errors_carry_codes(self):
        with self.assertRaises(epfabric.EpfError) as caught:
            epfabric.Buffer.attach(self.fabric.sockets[0], "api-normal", 0, "0" * 64)
        self.assertEqual(caught.exception.code_name, "PERMISSION_DENIED")
        with self.assertRaises(epfabric.EpfError) as caught:
            epfabric.Buffer.attach(self.fabric.sockets[0], "no-such-group", 0, self.token)
        self.assertEqual(caught.exception.code_name, "NOT_FOUND")
        with self.assertRaises(epfabric.EpfError) as caught:
            epfabric.Client(self.fabric.sockets[0] + ".missing")
        self.assertIn(caught.exception.code_name, ("NOT_FOUND", "UNAVAILABLE"))


if __name__ == "__main__":
    fabric.main()
