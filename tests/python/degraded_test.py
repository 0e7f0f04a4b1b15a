"""Issue #14: a group whose member is lost keeps serving in low-latency mode with the lost rank masked (elastic EP),
while normal mode fails fast with UNAVAILABLE. Three host-backend daemons; daemon 2 is killed."""
import time
import unittest

import fabric

fabric.require_torch()
import torch  # noqa: E402

import epfabric  # noqa: E402
from metrics_test import scrape  # noqa: E402

N, M, HIDDEN, TOPK, EXPERTS = 3, 8, 128, 2, 6
L = EXPERTS // N
FAST = ["--heartbeat_ms=100", "--heartbeat_misses=5", "--lease_ttl_ms=1000", "--metrics_listen=127.0.0.1:0"]


class DegradedGroupTest(unittest.TestCase):
    def test_low_latency_masks_the_lost_rank_normal_mode_fails_fast(self):
        with fabric.Fabric(N, extra_flags=FAST) as fab:
            client = epfabric.Client(fab.sockets[0])
            ll_bytes, _ = epfabric.required_group_bytes(M, HIDDEN, TOPK, EXPERTS, True, 1, N)
            ll_token = client.create_group("ll", list(range(N)), ll_bytes, 0, True)
            nvl, _ = epfabric.required_group_bytes(M, HIDDEN, TOPK, EXPERTS, False, 1, N)
            normal_token = client.create_group("normal", list(range(N)), nvl, 0, False)
            ll = fabric.run_ranks(N, lambda r: epfabric.Buffer.attach(fab.sockets[r], "ll", r, ll_token,
                                                                      timeout_s=2.0, enable_shrink=True,
                                                                      **fabric.attach_options(N)))
            normal = fabric.run_ranks(N, lambda r: epfabric.Buffer.attach(fab.sockets[r], "normal", r, normal_token,
                                                                          timeout_s=2.0))
            gens = [torch.Generator().manual_seed(r) for r in range(N)]
            ins = [(torch.randn(M, HIDDEN, generator=gens[r]).to(torch.bfloat16),
                    torch.stack([torch.randperm(EXPERTS, generator=gens[r])[:TOPK] for _ in range(M)]),
                    torch.rand(M, TOPK, generator=gens[r])) for r in range(N)]

            def ll_round(ranks):
                def body(r):
                    if r not in ranks:
                        return None
                    x, idx, w = fabric.to_dev(*ins[r])
                    recv, count, handle, _, _ = ll[r].low_latency_dispatch(x, idx, M, EXPERTS, use_fp8=False)
                    combined, _, _ = ll[r].low_latency_combine(recv, idx, w, handle)
                    mask = torch.zeros(N, dtype=torch.int32, device=x.device)
                    ll[r].low_latency_query_mask_buffer(mask)
                    return count, combined, mask
                return fabric.run_ranks(N, body)

            ll_round(set(range(N)))  # every rank, before the loss
            fab.procs[2].kill()
            fab.procs[2].wait()
            killed = time.monotonic()
            deadline = killed + 10
            while "DEGRADED" not in fab.epctl_run(0, "groups") or "DEGRADED" not in fab.epctl_run(1, "groups"):
                self.assertLess(time.monotonic(), deadline, "the group did not degrade within 10 s")
                time.sleep(0.05)
            time.sleep(0.6)  # a keep-alive (ttl / 3) brings the lost ranks to the leases

            outs = ll_round({0, 1})
            print(f"low latency served {time.monotonic() - killed:.2f} s after the kill", flush=True)
            for r in (0, 1):
                count, combined, mask = outs[r]
                self.assertEqual(mask.tolist(), [0, 0, 1], f"rank {r}: rank 2 masked")
                for le in range(L):
                    want = sum(int((idx == r * L + le).any(1).sum()) for s, (_, idx, _) in enumerate(ins) if s != 2)
                    self.assertEqual(int(count[le]), want, f"rank {r} expert {le}: nothing from the lost rank")
                x, idx, w = ins[r]
                alive = (idx >= 0) & (idx < 2 * L)
                weight = torch.where(alive, w, torch.zeros_like(w)).sum(1, keepdim=True)
                torch.testing.assert_close(combined.float(), x.float() * weight, rtol=2 ** -7, atol=1e-2)

            for r in (0, 1):  # check() publishes the mask into the counters page: /metrics shows one masked rank
                ll[r].check()
                values, _ = scrape(fab, r)
                self.assertEqual(values.get('epfabric_datapath_masked_ranks{group="ll"}'), 1, f"rank {r}")
            x, idx, w = fabric.to_dev(*ins[0])
            with self.assertRaises(epfabric.EpfError) as caught:  # normal mode: refused before anything runs
                per_rank, _, per_expert, in_rank, _ = normal[0].get_dispatch_layout(idx, EXPERTS)
                normal[0].dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, topk_idx=idx)
            self.assertEqual(caught.exception.code_name, "UNAVAILABLE")
            self.assertIn("DEGRADED", str(caught.exception))
            for b in ll[:2] + normal[:2]:
                b.destroy()
            client.close()


if __name__ == "__main__":
    fabric.main()
