"""The handles and hooks of epfabric.Buffer against the Buffer's lifetime (host-backend daemons): a dispatch handle, a
low-latency handle and a receive hook may go before or after their Buffer, after Buffer.destroy(), after the Buffer
was collected without destroy(), and at interpreter exit in any order, and nothing crashes or leaks: what a handle
frees goes back through the Buffer's allocator, which each handle keeps alive until it goes (epfabric.h)."""
import gc
import os
import subprocess
import sys
import textwrap
import weakref

import fabric
from buffer_cases import N, SEED, FabricCase, bf16, synchronized_buffer_class, topk_routing

fabric.require_torch()
import torch  # noqa: E402

import epfabric  # noqa: E402

HIDDEN, TOPK, EXPERTS, TOKENS = 128, 2, 8, 16
ORDERS = ("handle_first", "destroy_first", "collected_first")


class HandleLifetimeTest(FabricCase):
    def attach_all(self, low_latency):
        """A new group's Buffers, one per rank (nothing else keeps them: the test decides when they go)."""
        type(self).count += 1
        name = f"py-lifetime-{type(self).count}"
        nvl, rdma = epfabric.required_group_bytes(TOKENS, HIDDEN, TOPK, EXPERTS, low_latency, 1, N)
        token = self.client.create_group(name, list(range(N)), nvl, rdma, low_latency)
        self.addCleanup(self.client.delete_group, name, token)
        buffer_class = synchronized_buffer_class(N)  # the ranks (threads) make their C Buffers together
        return fabric.run_ranks(N, lambda r: buffer_class.attach(self.fabric.sockets[r], name, r, token,
                                                                 **fabric.attach_options(N)))

    def normal_round(self, bufs):
        """One dispatch on every rank; each rank's (handle, received rows)."""
        def rank(r):
            gen = torch.Generator().manual_seed(SEED + r)
            x, idx = fabric.to_dev(bf16(gen, TOKENS, HIDDEN), topk_routing(gen, TOKENS, EXPERTS, TOPK))
            per_rank, _, per_expert, in_rank, _ = bufs[r].get_dispatch_layout(idx, EXPERTS)
            recv_x, _, _, _, handle, _ = bufs[r].dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                          num_tokens_per_expert=per_expert, topk_idx=idx)
            return handle, recv_x
        return fabric.run_ranks(N, rank)

    def low_latency_round(self, bufs):
        """One low-latency dispatch with a receive hook on every rank; each rank's (handle, hook)."""
        def rank(r):
            gen = torch.Generator().manual_seed(SEED + 10 + r)
            x, idx = fabric.to_dev(bf16(gen, TOKENS, HIDDEN), topk_routing(gen, TOKENS, EXPERTS, TOPK))
            _, _, handle, _, hook = bufs[r].low_latency_dispatch(x, idx, TOKENS, EXPERTS, use_fp8=False,
                                                                 return_recv_hook=True)
            return handle, hook
        return fabric.run_ranks(N, rank)

    def release(self, order, bufs, handles):
        """Drops `handles` (and the test's Buffers) in `order`; returns weak references to the Buffers' allocators,
        which must be gone once everything is."""
        allocators = [weakref.ref(b._alloc) for b in bufs]
        if order == "handle_first":
            handles.clear()
            gc.collect()
            [b.destroy() for b in bufs]
        elif order == "destroy_first":
            [b.destroy() for b in bufs]
            handles.clear()
        else:  # the Buffers are collected (their __del__ releases them) while the handles live on
            bufs.clear()
            gc.collect()
            self.assertTrue(all(a() is not None for a in allocators), "a handle's allocator went with its Buffer")
            handles.clear()
        bufs.clear()
        gc.collect()
        return allocators

    def test_dispatch_handles_in_every_order(self):
        for order in ORDERS:
            with self.subTest(order=order):
                bufs = self.attach_all(False)
                outs = self.normal_round(bufs)
                handles = [h for h, _ in outs]
                rows = [x for _, x in outs]
                self.assertTrue(all(len(h) == 6 for h in handles))
                del outs
                allocators = self.release(order, bufs, handles)
                gc.collect()
                self.assertTrue(all(x.numel() > 0 for x in rows), "the received rows stay the caller's tensors")
                gc.collect()
                self.assertTrue(all(a() is None for a in allocators), f"{order}: an allocator was kept (a leak)")

    def test_low_latency_handles_and_hooks_in_every_order(self):
        for order in ORDERS:
            with self.subTest(order=order):
                bufs = self.attach_all(True)
                outs = self.low_latency_round(bufs)
                handles = [h for h, _ in outs] + [k for _, k in outs]
                del outs
                allocators = self.release(order, bufs, handles)
                self.assertTrue(all(a() is None for a in allocators), f"{order}: an allocator was kept (a leak)")

    def test_a_hook_after_its_buffer_was_destroyed_is_refused(self):
        bufs = self.attach_all(True)
        outs = self.low_latency_round(bufs)
        for b in bufs:
            b.destroy()
        for handle, hook in outs:
            with self.assertRaises(epfabric.EpfError) as caught:
                hook()
            self.assertEqual(caught.exception.code_name, "FAILED_PRECONDITION")
            self.assertIn("destroyed", str(caught.exception))

    def test_interpreter_exit_in_any_order(self):
        """A process that exits holding handles, with its Buffers in reference cycles or collected before exit,
        destroyed or not, exits cleanly (PYTHONMALLOC=debug: a freed callback's memory does not pass for live)."""
        script = textwrap.dedent("""
            import os, sys
            sys.path.insert(0, os.environ["EPF_TEST_DIR"])
            import buffer_cases, fabric, torch
            sockets, name, token = os.environ["SOCKETS"].split(","), os.environ["GROUP"], os.environ["TOKEN"]
            low_latency, destroy, drop = (os.environ[k] == "1" for k in ("LL", "DESTROY", "DROP"))
            buffer_class = buffer_cases.synchronized_buffer_class(len(sockets))
            keep = []
            def rank(r):
                b = buffer_class.attach(sockets[r], name, r, token, **fabric.attach_options(len(sockets)))
                gen = torch.Generator().manual_seed(r)
                x, idx = fabric.to_dev((torch.randn(16, 128, generator=gen)).to(torch.bfloat16),
                                       torch.randint(0, 8, (16, 1), generator=gen))
                if low_latency:
                    out = b.low_latency_dispatch(x, idx, 16, 8, use_fp8=False, return_recv_hook=True)
                else:
                    l = b.get_dispatch_layout(idx, 8)
                    out = b.dispatch(x, num_tokens_per_rank=l[0], is_token_in_rank=l[3], num_tokens_per_expert=l[2],
                                     topk_idx=idx)
                cycle = {"buffer": b, "out": out}
                cycle["self"] = cycle
                keep.append(cycle)
                return b
            bufs = fabric.run_ranks(len(sockets), rank)
            outs = [cycle["out"] for cycle in keep]  # the handles, held to the end
            if destroy:
                [b.destroy() for b in bufs]
            if drop:  # the Buffers go (and a collection) before exit, the handles stay
                bufs = keep = None
                import gc
                gc.collect()
            print("exiting", flush=True)
        """)
        cases = [(ll, d, dr) for ll in (False, True) for d in (False, True) for dr in (False, True)]
        for low_latency, destroy, drop in cases:
            with self.subTest(low_latency=low_latency, destroy=destroy, drop=drop):
                type(self).count += 1
                name = f"py-exit-{type(self).count}"
                nvl, rdma = epfabric.required_group_bytes(16, 128, 1, 8, low_latency, 1, N)
                token = self.client.create_group(name, list(range(N)), nvl, rdma, low_latency)
                self.addCleanup(self.client.delete_group, name, token)
                env = dict(os.environ, EPF_TEST_DIR=os.path.dirname(os.path.abspath(__file__)),
                           SOCKETS=",".join(self.fabric.sockets), GROUP=name, TOKEN=token,
                           LL=str(int(low_latency)), DESTROY=str(int(destroy)), DROP=str(int(drop)),
                           PYTHONFAULTHANDLER="1", PYTHONMALLOC="debug")
                done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                      timeout=120)
                self.assertEqual(done.returncode, 0, f"exit status {done.returncode}:\n{done.stdout}{done.stderr}")
                self.assertIn("exiting", done.stdout)
                self.assertNotIn("Fatal Python error", done.stderr)


if __name__ == "__main__":
    fabric.main()
