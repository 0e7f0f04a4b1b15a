"""The drop-in's first-run errors and exit path (issue 37): each error names its cause, and the group rank 0 created is
deleted at interpreter exit even when its Detach fails.
  - EPFABRIC_SOCKET without {local_rank} for two ranks says so (not "ranks: 0 appears twice");
  - a dispatch that does not fit the group's memory says the bytes it needs;
  - a Detach that fails at exit still leaves no group on the daemons.
Each case runs in fresh interpreters (torch.distributed with gloo over a file store)."""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

import fabric

PROLOGUE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, os.environ["EPF_PYTHON_DIR"])
    import torch
    import torch.distributed as dist
    from epfabric import deep_ep
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=world)
""")


def run_ranks(body, world, socket_env, timeout=120):
    """Runs PROLOGUE + body in `world` processes; returns [(exit code, output)]."""
    store = tempfile.mktemp(prefix="epf-store-")
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD=str(world), STORE=store, LOCAL_RANK=str(r),
                   EPFABRIC_SOCKET=socket_env, EPF_PYTHON_DIR=str(fabric.ROOT / "python"))
        procs.append(subprocess.Popen([sys.executable, "-c", PROLOGUE + textwrap.dedent(body)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        results.append((p.returncode, out))
    return results


class FirstRun(unittest.TestCase):
    def test_one_socket_for_two_ranks_names_the_template(self):
        with fabric.Fabric(1) as fab:
            results = run_ranks("""
                try:
                    deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20)
                except RuntimeError as error:
                    print("ERROR:", error)
            """, 2, fab.sockets[0])
        for code, out in results:
            self.assertEqual(code, 0, out)
            self.assertIn("group ranks [0, 1] all reach the daemon of fabric rank 0", out)
            self.assertIn("it has no {local_rank}", out)
            self.assertNotIn("appears twice", out)

    def test_a_group_too_small_says_the_bytes_it_needs_and_is_deleted_at_exit_when_detach_fails(self):
        with fabric.Fabric(2) as fab:
            results = run_ranks("""
                import epfabric.buffer
                from epfabric._lib import EpfError
                buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 10)
                print("GROUP", buffer.group_name)
                x = torch.randn(256, 2048).to(torch.bfloat16)
                topk_idx = torch.stack([torch.randperm(8)[:4] for _ in range(256)])
                try:
                    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 8)
                    buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                    topk_weights=torch.ones(256, 4))
                    print("NO ERROR")
                except ValueError as error:
                    print("ERROR:", error)
                real_call = epfabric.buffer.call
                def failing_detach(name, *args):
                    if name == "epf_lease_detach":
                        raise EpfError(4, "Detach: deadline exceeded (injected)", name)
                    return real_call(name, *args)
                epfabric.buffer.call = failing_detach
                dist.barrier()
            """, 2, str(fab.dir / "d{local_rank}.sock"))
            for code, out in results:
                self.assertEqual(code, 0, out)
                self.assertRegex(out, r"needs \d+ NVL and \d+ RDMA bytes per rank")
            self.assertIn("GROUP deep_ep-", results[0][1])
            for r in range(2):
                groups = json.loads(fab.epctl_run(r, "groups", "--json"))["groups"]
                self.assertEqual(groups, [], f"rank {r}'s daemon still holds {groups}")


if __name__ == "__main__":
    fabric.main()
