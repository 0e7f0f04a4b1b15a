"""The host collectives the drop-in needs from its caller's process group: DeepEP's Buffer takes a torch.distributed
group, or an mpi4py communicator (`comm`) when the group is None. The data path never uses them: they carry the group
token at construction, the barriers around a C Buffer's replacement, and the optional rank_prefix_matrix gather."""
from typing import Any, List

import torch
import torch.distributed as dist


class ProcessGroupCollectives:
    """Collectives over a torch.distributed process group (gloo or NCCL)."""

    def __init__(self, group: "dist.ProcessGroup") -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, in group-rank order."""
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Group rank 0's `obj` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=_global_rank(self.group, 0), group=self.group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_gather_tensor(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's `tensor` (same shape on every rank), on `tensor`'s device (gloo gathers host tensors)."""
        on = "cpu" if dist.get_backend(self.group) == "gloo" else tensor.device
        mine = tensor.to(on).contiguous()
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(rows, mine, group=self.group)
        return [row.to(tensor.device) for row in rows]


class CommCollectives:
    """Collectives over an mpi4py communicator (DeepEP's `comm`: Get_rank, Get_size, allgather, bcast, Barrier)."""

    def __init__(self, comm: Any) -> None:
        self.group = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def all_gather_object(self, obj: Any) -> List[Any]:
        return list(self.group.allgather(obj))

    def broadcast_object(self, obj: Any) -> Any:
        return self.group.bcast(obj, root=0)

    def barrier(self) -> None:
        self.group.Barrier()

    def all_gather_tensor(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        return [row.to(tensor.device) for row in self.group.allgather(tensor.cpu())]


def collectives_for(group: "dist.ProcessGroup | None", comm: Any = None) -> "ProcessGroupCollectives | CommCollectives":
    """The collectives for DeepEP's (group, comm) pair: the group when given, else the communicator.

    Arguments:
        group: a torch.distributed process group, or None.
        comm: an mpi4py communicator, used when group is None.

    Returns:
        collectives: the rank, size and host collectives of the group.
    """
    if group is not None:
        return ProcessGroupCollectives(group)
    if comm is not None:
        return CommCollectives(comm)
    raise ValueError("either group (a torch.distributed process group) or comm (an mpi4py communicator) must be "
                     "given, as DeepEP's Buffer requires")


def _global_rank(group: "dist.ProcessGroup", group_rank: int) -> int:
    if group is None or group == dist.group.WORLD:
        return group_rank
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank  # torch < 2.0
    return get(group, group_rank)
