"""Data-path metrics (issue #16): after known traffic through Python Buffers on host-backend daemons, each daemon's
/metrics shows the calls, tokens, bytes, failures and expert load its rank's client published in the counters page
(no RPC on the data path), with the right names, types, labels and values."""
import json
import re
import unittest
import urllib.request

import fabric

fabric.require_torch()
import torch  # noqa: E402

import epfabric  # noqa: E402

N = 2
HIDDEN, TOPK, EXPERTS = 128, 2, 8
L = EXPERTS // N


def scrape(fab, r):
    topology = json.loads(fab.epctl_run(r, "topology", "--json"))
    address = topology["daemon"]["metrics_address"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    values, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values, types


def routing(gen, n):
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(n)])
    idx[torch.rand(n, TOPK, generator=gen) < 0.25] = -1
    return idx


class DataPathMetricsTest(unittest.TestCase):
    def test_counters_and_expert_load_after_known_traffic(self):
        with fabric.Fabric(N, extra_flags=["--metrics_listen=127.0.0.1:0", "--metrics_expert_series"]) as fab:
            client = epfabric.Client(fab.sockets[0])
            nvl, _ = epfabric.required_group_bytes(32, HIDDEN, TOPK, EXPERTS, False, 1, N)
            normal_token = client.create_group("m-normal", [0, 1], nvl, 0, False)
            ll_nvl, _ = epfabric.required_group_bytes(16, HIDDEN, TOPK, EXPERTS, True, 1, N)
            ll_token = client.create_group("m-ll", [0, 1], ll_nvl, 0, True)
            gens = [torch.Generator().manual_seed(r) for r in range(N)]
            rounds = [[(torch.randn(20 + 3 * r + i, HIDDEN, generator=gens[r]).to(torch.bfloat16),
                        routing(gens[r], 20 + 3 * r + i)) for i in range(3)] for r in range(N)]
            ll_rounds = 70  # more than the 64-call publishing period; check() publishes the rest
            ll_inputs = [[(torch.randn(16 - r, HIDDEN, generator=gens[r]).to(torch.bfloat16),
                           routing(gens[r], 16 - r)) for _ in range(ll_rounds)] for r in range(N)]

            def normal(r):
                b = epfabric.Buffer.attach(fab.sockets[r], "m-normal", r, normal_token)
                received = 0
                for x, idx in rounds[r]:
                    x, idx = fabric.to_dev(x, idx)
                    per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, EXPERTS)
                    recv_x, _, _, _, handle, _ = b.dispatch(x, num_tokens_per_rank=per_rank,
                                                            is_token_in_rank=in_rank,
                                                            num_tokens_per_expert=per_expert, topk_idx=idx)
                    received += recv_x.shape[0]
                    b.combine(recv_x, handle)
                b.check()  # publishing the low-latency totals must leave normal mode's counts alone
                if r == 0:  # refused by the library (rows differ from the layout's): one error
                    with self.assertRaises(epfabric.EpfError):
                        b.dispatch(x[:-1], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, topk_idx=idx)
                b.destroy()
                return received

            def low_latency(r):
                b = epfabric.Buffer.attach(fab.sockets[r], "m-ll", r, ll_token, **fabric.attach_options(N))
                for x, idx in ll_inputs[r]:
                    x, idx = fabric.to_dev(x, idx)
                    recv, _, handle, _, _ = b.low_latency_dispatch(x, idx, 16, EXPERTS, use_fp8=False)
                    b.low_latency_combine(recv, idx, torch.ones(idx.shape, device=x.device), handle)
                b.check()
                b.destroy()

            received = fabric.run_ranks(N, normal)
            fabric.run_ranks(N, low_latency)
            client.close()

            for r in range(N):
                values, types = scrape(fab, r)
                with self.subTest(rank=r):
                    for name, kind in [("epfabric_datapath_calls_total", "counter"),
                                       ("epfabric_datapath_tokens_total", "counter"),
                                       ("epfabric_datapath_bytes_total", "counter"),
                                       ("epfabric_datapath_failures_total", "counter"),
                                       ("epfabric_expert_tokens_received_rank_total", "counter"),
                                       ("epfabric_expert_load_imbalance", "gauge"),
                                       ("epfabric_expert_tokens_received_total", "counter")]:
                        self.assertEqual(types.get(name), kind, name)

                    def at(key):
                        self.assertIn(key, values, f"rank {r}: no series {key}")
                        return values[key]

                    tokens = sum(x.shape[0] for x, _ in rounds[r])
                    dispatches = at('epfabric_datapath_calls_total{group="m-normal",op="dispatch"}')
                    self.assertEqual(dispatches, 4 if r == 0 else 3)
                    self.assertEqual(at('epfabric_datapath_calls_total{group="m-normal",op="combine"}'), 3)
                    self.assertEqual(at('epfabric_datapath_tokens_total{group="m-normal",direction="sent"}'), tokens)
                    self.assertEqual(at('epfabric_datapath_bytes_total{group="m-normal",direction="sent"}'),
                                     tokens * HIDDEN * 2)
                    self.assertEqual(at('epfabric_datapath_tokens_total{group="m-normal",direction="received"}'),
                                     received[r])
                    self.assertEqual(at('epfabric_datapath_bytes_total{group="m-normal",direction="received"}'),
                                     received[r] * HIDDEN * 2)
                    self.assertEqual(at('epfabric_datapath_failures_total{group="m-normal",kind="error"}'),
                                     1 if r == 0 else 0)
                    self.assertEqual(at('epfabric_datapath_failures_total{group="m-normal",kind="timeout"}'), 0)
                    self.assertEqual(at('epfabric_datapath_masked_ranks{group="m-ll"}'), 0)
                    self.assertEqual(types.get("epfabric_datapath_masked_ranks"), "gauge")
                    for group, rounds_of in (("m-normal", rounds), ("m-ll", ll_inputs)):
                        want = [sum(int((idx == r * L + e).sum()) for rr in range(N) for _, idx in rounds_of[rr])
                                for e in range(L)]
                        if group == "m-ll":  # low latency counts a token once per expert (distinct experts here)
                            want = [sum(int((idx == r * L + e).any(1).sum()) for rr in range(N)
                                        for _, idx in rounds_of[rr]) for e in range(L)]
                        for e in range(L):
                            self.assertEqual(
                                at(f'epfabric_expert_tokens_received_total{{group="{group}",expert="{r * L + e}"}}'),
                                want[e], f"{group} expert {r * L + e}")
                        self.assertEqual(at(f'epfabric_expert_tokens_received_rank_total{{group="{group}"}}'),
                                         sum(want))
                        self.assertAlmostEqual(at(f'epfabric_expert_load_imbalance{{group="{group}"}}'),
                                               max(want) / (sum(want) / L), places=6)
                    self.assertEqual(at('epfabric_datapath_calls_total{group="m-ll",op="low_latency_dispatch"}'),
                                     ll_rounds)
                    self.assertEqual(at('epfabric_datapath_calls_total{group="m-ll",op="low_latency_combine"}'),
                                     ll_rounds)
                    self.assertEqual(at('epfabric_datapath_tokens_total{group="m-ll",direction="sent"}'),
                                     sum(x.shape[0] for x, _ in ll_inputs[r]))
                    table = fab.epctl_run(r, "stats", "--group=m-ll")
                    self.assertRegex(table, r"expert load \(this rank\)")
                    self.assertRegex(table, r"m-ll\s+%d\s+" % sum(want))  # want: m-ll's, from the loop above
                    self.assertFalse([k for k in values if re.search(r"token=|lease_id=|pid=|uid=", k)],
                                     "no tokens, leases, pids or uids in the series")


if __name__ == "__main__":
    fabric.main()
