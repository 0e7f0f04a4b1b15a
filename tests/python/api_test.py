"""epfabric's Python API around the data path: bad input is a Python exception with a clear message and nothing is
launched (the next valid call of every rank still works), mode mismatches, the local buffer tensor, size hints,
errors from the daemon, and that epfabric.deep_ep.Buffer has DeepEP's method names and parameters."""
import inspect
import unittest

import deep_ep_signatures as signatures
import fabric

fabric.require_torch()
import torch  # noqa: E402

import epfabric  # noqa: E402
from epfabric import deep_ep  # noqa: E402

N = 2
HIDDEN, TOPK, EXPERTS = 256, 2, 8

# Where DeepEP's V1 lines put a parameter at another position, the drop-in follows the early-2026 line (567632d);
# the others' callers pass those by keyword (DeepEP's own dispatch calls internode_dispatch with its line's order).
KEYWORD_ONLY = {("V1_2_1", "__init__"), ("V1_2_1", "internode_dispatch"), ("LEGACY", "__init__"),
                ("LEGACY", "internode_dispatch")}


def parse(recorded):
    """A recorded signature ("@a, b=1") as (is static, [(name, default as written, or None)])."""
    static, text = recorded.startswith("@"), recorded.lstrip("@")
    params = []
    for part in filter(None, (p.strip() for p in text.split(", "))):
        name, _, default = part.partition("=")
        params.append((name, default or None))
    return static, params


def ours(fn):
    """epfabric's parameters of `fn` as [(name, repr of the default, or None)], without self."""
    return [(p.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def differences(label, owner, recorded):
    """How `owner` (a class or module) differs from the recorded signatures: a list of messages."""
    found = []
    for method, signature in recorded.items():
        static, params = parse(signature)
        if not hasattr(owner, method):
            found.append(f"{label}: {method} is missing")
            continue
        got = ours(getattr(owner, method))
        got_names = [name for name, _ in got]
        for name, default in params:
            if name not in got_names:
                found.append(f"{label}.{method}: parameter {name} is missing")
            elif dict(got)[name] != default:
                found.append(f"{label}.{method}({name}=...): default {dict(got)[name]}, DeepEP's {default}")
        if (label, method) not in KEYWORD_ONLY and got_names[:len(params)] != [name for name, _ in params]:
            found.append(f"{label}.{method}: order {got_names}, DeepEP's {[name for name, _ in params]}")
        if isinstance(owner, type) and isinstance(inspect.getattr_static(owner, method), staticmethod) != static:
            found.append(f"{label}.{method}: staticmethod should be {static}")
    return found


class SignatureTest(unittest.TestCase):
    """epfabric.deep_ep against DeepEP's signatures (deep_ep_signatures.py, recorded from DeepEP's repository): every
    public method and function of both V1 lines, DeepEP 2's legacy Buffer and DeepEP 2's ElasticBuffer, EPHandle,
    EventOverlap, EventHandle and Config exists, takes every parameter by keyword with DeepEP's default, in DeepEP's
    order (but KEYWORD_ONLY), static where DeepEP's is."""

    def check(self, label, owner, recorded):
        self.assertEqual(differences(label, owner, recorded), [])

    def test_v1_buffer_of_both_lines_and_deep_ep_2s_legacy_buffer(self):
        for label in ("V1_2_1", "V1_EARLY_2026", "LEGACY"):
            self.check(label, deep_ep.Buffer, getattr(signatures, label))

    def test_deep_ep_2(self):
        self.check("ELASTIC_BUFFER", deep_ep.ElasticBuffer, signatures.ELASTIC_BUFFER)
        self.check("EP_HANDLE", deep_ep.EPHandle, signatures.EP_HANDLE)
        self.check("EVENT_OVERLAP", deep_ep.EventOverlap, signatures.EVENT_OVERLAP)
        self.check("EVENT_HANDLE", deep_ep.EventHandle, signatures.EVENT_HANDLE)
        self.check("CONFIG", deep_ep.Config, signatures.CONFIG)
        self.check("FUNCTIONS", deep_ep, signatures.FUNCTIONS)
        for name in signatures.MODULE_NAMES:
            self.assertTrue(hasattr(deep_ep, name), name)
            self.assertIn(name, deep_ep.__all__)

    def test_the_check_reports_each_kind_of_difference(self):
        class Wrong:
            def dispatch(self, x, handle=2, num_tokens_per_rank=None):
                pass

            def combine(self, handle, x):
                pass

        for recorded, needle in (({"dispatch": "x, handle=None"}, "default"),
                                 ({"dispatch": "x, handle=2, topk_idx=None"}, "parameter topk_idx"),
                                 ({"combine": "x, handle"}, "order"), ({"dispatch": "@x, handle=2"}, "staticmethod"),
                                 ({"low_latency_dispatch": "x"}, "missing")):
            found = differences("Wrong", Wrong, recorded)
            self.assertTrue(any(needle in d for d in found), (recorded, found))
        self.assertEqual(differences("Wrong", Wrong, {"dispatch": "x, handle=2"}), [])

    def test_deep_ep_module_names(self):
        """The module-level names DeepEP's tests use: topk_idx_t (int64, as DeepEP's), __version__ (DeepEP's version
        marked as epfabric's), and Buffer.is_sm90_compiled() (True: the FP8 paths exist on every backend)."""
        self.assertIs(deep_ep.topk_idx_t, torch.int64)
        self.assertIsInstance(deep_ep.__version__, str)
        self.assertRegex(deep_ep.__version__, r"^2\.1\.0\+epfabric")
        self.assertIs(deep_ep.Buffer.is_sm90_compiled(), True)
        self.assertIs(epfabric.Buffer.is_sm90_compiled(), True)
        self.assertTrue(hasattr(deep_ep.EventOverlap(), "current_stream_wait"))


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
        cls.bufs = fabric.run_ranks(
            N, lambda r: epfabric.Buffer.attach(cls.fabric.sockets[r], "api-normal", r, cls.token))

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
        bf16 = dict(dtype=torch.bfloat16, device=dev)
        cases = [
            ("x.dtype", TypeError, lambda: b.dispatch(x.float(), **layout, topk_idx=idx)),
            ("not contiguous", ValueError, lambda: b.dispatch(torch.zeros(HIDDEN, 4, **bf16).t(),
                                                              **layout, topk_idx=idx)),
            ("dimensions", ValueError, lambda: b.dispatch(x[0], **layout, topk_idx=idx)),
            ("topk_idx.dtype", TypeError, lambda: b.dispatch(x, **layout, topk_idx=idx.int())),
            ("required unless handle", ValueError, lambda: b.dispatch(x, topk_idx=idx)),
            ("torch.Tensor", TypeError, lambda: b.dispatch([1, 2], **layout, topk_idx=idx)),
            ("hidden = ", ValueError, lambda: b.dispatch(torch.zeros(4, 2 * HIDDEN, dtype=torch.bfloat16, device=dev),
                                                         **layout, topk_idx=idx)),
            ("INVALID_ARGUMENT", epfabric.EpfError, lambda: b.dispatch(torch.zeros(3, HIDDEN, **bf16),
                                                                       **layout, topk_idx=idx)),
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
