"""A drop-in for DeepEP's Python API: `from epfabric import deep_ep` instead of `import deep_ep`.

`Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, ...)` (DeepEP V1, and the legacy Buffer of DeepEP 2)
takes a torch.distributed process group (or an mpi4py `comm`) as DeepEP's does; `ElasticBuffer(group, ...)` is DeepEP
2's (elastic.py), over a Buffer of this module. Each process talks to the daemon at $EPFABRIC_SOCKET ("{local_rank}"
and "{rank}" are filled in, for one daemon per GPU; a comma-separated list names local rank i's socket at position
i). Group rank 0 creates the EP group through its daemon over the daemons of every process (or uses $EPFABRIC_GROUP
with the token in $EPFABRIC_TOKEN, for groups an operator made) and broadcasts the token over the process group;
every rank attaches. docs/python.md lists where behaviour differs from DeepEP.
"""
import atexit
import ctypes
import os
import uuid
import warnings
import weakref
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _sizing
from . import buffer as _buffer
from . import elastic as _elastic
from ._collectives import collectives_for
from ._handles import DispatchHandle, LowLatencyHandle, UnavailableField
from ._lib import EpfError, call
from .client import Client
from .elastic import EPHandle
from .utils import Config, EventHandle, EventOverlap

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "Config", "topk_idx_t",
           "get_physical_domain_size", "get_logical_domain_size", "__version__", "DispatchHandle", "LowLatencyHandle",
           "UnavailableField"]

# DeepEP's version this drop-in follows (V1's Buffer as DeepEP 2 keeps it, and V2's ElasticBuffer), marked as
# epfabric's.
__version__ = "2.1.0+epfabric"
# The dtype of top-k expert indices (DeepEP's topk_idx_t).
topk_idx_t = torch.int64


def _socket_path(rank: int) -> str:
    template = os.environ.get("EPFABRIC_SOCKET")
    if not template:
        raise RuntimeError("EPFABRIC_SOCKET is not set: the path of this process's epfabric daemon socket (e.g. "
                           "/run/epfabric/gpu{local_rank}.sock)")
    if "LOCAL_RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
    elif torch.cuda.is_available():
        local_rank = torch.cuda.current_device()
    else:
        local_rank = rank
    if "," in template:  # one socket per local rank, in order (what epfabric's device plugin hands a container)
        sockets = template.split(",")
        if local_rank >= len(sockets):
            raise RuntimeError(f"EPFABRIC_SOCKET lists {len(sockets)} sockets; local rank {local_rank} has none")
        return sockets[local_rank]
    return template.format(local_rank=local_rank, rank=rank)


_PART_ALIGNMENT = 4096  # a group's normal-mode part ends on this boundary (CreateGroup's num_normal_bytes)


def _align(size):
    return -(-size // _PART_ALIGNMENT) * _PART_ALIGNMENT


def _group_bytes(num_nvl_bytes, num_rdma_bytes, low_latency_mode, group_size, num_hosts):
    """DeepEP's sizes to CreateGroup's (num_nvl_bytes, num_rdma_bytes, num_normal_bytes, num_normal_rdma_bytes) for a
    group over `group_size` ranks on `num_hosts` hosts (the daemons' host ids, not DeepEP's 8 GPUs per host).

    One host: low latency runs in the NVL region, which DeepEP sizes through num_rdma_bytes
    (get_low_latency_rdma_size_hint); a low_latency_mode Buffer with both sizes also runs normal mode in its NVL buffer
    (SGLang's auto mode): the group gets a normal-mode part of num_nvl_bytes, then the low-latency part.
    Across hosts: normal mode takes both sizes as given (the RDMA region holds the tokens between hosts); low latency
    keeps its layout over all ranks in the NVL region (the size hint) and needs, in the RDMA region, an inbox (its two
    halves) and an outbox per rank (this rank's slots only): exact when the size came from
    get_low_latency_rdma_size_hint in this process (the shape is known), else 2 x the size + 4096 bytes per rank, an
    upper bound (the inbox is at most the size, the outboxes together about one half more), with a warning. A
    low_latency_mode Buffer with both sizes (auto mode) gets both: normal-mode parts of num_nvl_bytes and
    num_rdma_bytes (DeepEP's callers pass the larger of the two modes' RDMA sizes there), then low latency's."""
    if num_hosts == 1:
        if low_latency_mode:
            if num_nvl_bytes > 0 and num_rdma_bytes > 0:
                normal = _align(num_nvl_bytes)
                return normal + num_rdma_bytes, 0, normal, 0
            return max(num_nvl_bytes, num_rdma_bytes), 0, 0, 0
        return num_nvl_bytes, 0, 0, 0
    if low_latency_mode:
        both = num_nvl_bytes > 0 and num_rdma_bytes > 0
        region = num_rdma_bytes if num_rdma_bytes > 0 else num_nvl_bytes
        shape = _sizing.low_latency_shape_of(region, group_size if both else None)
        if shape is not None and shape[2] == group_size:
            tokens, hidden, _, experts = shape
            nvl, rdma = _sizing.required_group_bytes(tokens, hidden, 9, experts, True, num_hosts,
                                                     group_size // num_hosts)
        else:
            warnings.warn(f"epfabric: {region} bytes did not come from get_low_latency_rdma_size_hint({group_size} "
                          f"ranks) in this process: the RDMA region gets 2 x that + 4096 x {group_size}, an upper "
                          "bound", RuntimeWarning, stacklevel=3)
            nvl, rdma = region, 2 * region + 4096 * group_size
        if not both:
            return nvl, rdma, 0, 0
        normal, normal_rdma = _align(num_nvl_bytes), _align(num_rdma_bytes)
        return normal + nvl, normal_rdma + rdma, normal, normal_rdma
    if num_rdma_bytes <= 0:
        raise ValueError(f"epfabric: the group spans {num_hosts} hosts: normal mode needs num_rdma_bytes > 0 (the "
                         "tokens between hosts travel through the RDMA region), as DeepEP's internode mode does")
    return num_nvl_bytes, num_rdma_bytes, 0, 0


def _num_hosts(host_ids: List[str]) -> int:
    """How many hosts the group spans, from its ranks' host ids in group-rank order. The internode path needs the
    ranks of one host together and the same number on every host (group rank = host * ranks_per_host + local)."""
    hosts = list(dict.fromkeys(host_ids))
    per_host = len(host_ids) // len(hosts)
    expected = [h for h in hosts for _ in range(per_host)]
    if expected != list(host_ids):
        raise ValueError(f"epfabric: the process group's ranks are not host-major with equal ranks per host (host ids "
                         f"in group-rank order: {host_ids}); order the ranks host by host")
    return len(hosts)


def _check_one_daemon_per_rank(fabric_ranks):
    """Each process of the group needs its own daemon (one per GPU): several processes that reach the same daemon
    mean that $EPFABRIC_SOCKET names one socket for all of them."""
    shared = {}
    for group_rank, fabric_rank in enumerate(fabric_ranks):
        shared.setdefault(fabric_rank, []).append(group_rank)
    for fabric_rank, group_ranks in shared.items():
        if len(group_ranks) > 1:
            template = os.environ.get("EPFABRIC_SOCKET", "")
            hint = ("it has no {local_rank}: write e.g. /run/epfabric/gpu{local_rank}.sock, one daemon per GPU"
                    if "{local_rank}" not in template and "{rank}" not in template else
                    "its {local_rank}/{rank} resolves to one daemon for them (check LOCAL_RANK and each daemon's "
                    "--rank)")
            raise RuntimeError(f"epfabric: group ranks {group_ranks} all reach the daemon of fabric rank {fabric_rank} "
                               f"through EPFABRIC_SOCKET={template!r}; {hint}")


_CREATED = weakref.WeakSet()
# (socket, name, token) of every group this process created and has not deleted yet, by name: kept after its Buffer
# is collected, so that the exit handler deletes it even then.
_OWNED_GROUPS = {}


class Buffer(_buffer.Buffer):
    """DeepEP's Buffer over a torch.distributed process group.

    As DeepEP's, it serves any call whose sizes fit the memory given at construction: hidden size, top-k, experts and
    tokens may change from call to call. The library's C Buffer is set up for one shape; a call it does not serve
    replaces it, on every rank at that same call, by one for a shape that covers both (normal mode: the larger hidden
    size and top-k, this call's experts and SMs; low latency: this call's tokens per rank, hidden size and experts,
    the larger top-k), or for the call's own shape when only that fits. This assumes that every rank of the group
    makes the same sequence of calls with the same shapes (as DeepEP's callers do): the replacement synchronizes the
    ranks over the process group (two barriers), which a rank that does not make the call would leave waiting. A call
    that does not fit the group's memory raises ValueError with the bytes it needs and the bytes the group has. A
    handle from before a replacement is refused by combine (dispatch again).
    """

    def __init__(self, group: Optional["dist.ProcessGroup"], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Optional[Any] = None) -> None:
        """Creates the EP group over the daemons of every rank (group rank 0) and attaches this rank. Every rank
        calls it, as DeepEP's. The parameters of both V1 lines (v1.2.1; the early-2026 line with use_fabric and
        enable_shrink; DeepEP 2's legacy Buffer without use_fabric) are accepted by keyword with DeepEP's meaning;
        use_fabric's position is the early-2026 line's.

        Arguments:
            group: the torch.distributed process group, or None with `comm`.
            num_nvl_bytes: DeepEP's buffer size for intranode communication (normal mode's region).
            num_rdma_bytes: DeepEP's buffer size for internode communication, and low latency's within a host.
            low_latency_mode: create a low-latency group (with num_nvl_bytes too: it also serves normal mode).
            num_qps_per_rank: accepted (DeepEP's RDMA queue pairs per rank; the daemons own the transport).
            allow_nvlink_for_low_latency_mode: accepted (low latency within a host always goes over NVLink/IPC).
            allow_mnnvl: accepted (the daemons' host ids decide what is one host).
            use_fabric: accepted (DeepEP's fabric memory API; the daemons own and share the regions).
            explicitly_destroy: destroy() must be called (every rank); else the resources go when the Buffer is
                collected or the process exits.
            enable_shrink: low latency masks a lost or silent rank and goes on without it (the mask calls).
            comm: an mpi4py communicator, used when group is None (its allgather, bcast and Barrier).
        """
        self.group = group if group is not None else comm
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._owns_group = None
        self._collectives = collectives_for(group, comm)
        rank, size = self._collectives.rank, self._collectives.size
        client = Client(_socket_path(rank), client_name=f"deep_ep rank {rank}")
        # (fabric rank, host id) of each group rank's daemon
        members = self._collectives.all_gather_object((client.daemon_info().fabric_rank, client.host_id()))
        fabric_ranks = [fabric_rank for fabric_rank, _ in members]
        _check_one_daemon_per_rank(fabric_ranks)
        named = os.environ.get("EPFABRIC_GROUP")
        shared = None
        if rank == 0:
            try:
                if named:
                    shared = (named, os.environ.get("EPFABRIC_TOKEN", ""), None)
                else:
                    name = f"deep_ep-{uuid.uuid4().hex[:12]}"
                    num_hosts = _num_hosts([host for _, host in members])
                    nvl, rdma, normal, normal_rdma = _group_bytes(num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                                                                  size, num_hosts)
                    token = client.create_group(name, fabric_ranks, nvl, rdma, low_latency_mode, normal, normal_rdma)
                    shared = (name, token, None)
            except (EpfError, ValueError) as error:
                shared = (None, None, str(error))
        name, token, error = self._collectives.broadcast_object(shared)
        if error is not None:
            raise RuntimeError(f"epfabric: group rank 0 could not create the EP group: {error}")
        if rank == 0 and not named:
            self._owns_group = (client.socket, name, token)
        lease = ctypes.c_void_p()
        call("epf_attach", client.handle, name.encode(), rank, token.encode(), -1, ctypes.byref(lease))
        super().__init__(client, lease, enable_shrink=enable_shrink)
        self.group_name = name
        if self.low_latency_mode != bool(low_latency_mode):
            raise RuntimeError(f"group {name} was created with low_latency={self.low_latency_mode}, the Buffer asks "
                               f"for low_latency_mode={low_latency_mode}")
        if self._owns_group is not None:
            _CREATED.add(self)
            _OWNED_GROUPS[name] = self._owns_group
        self._collectives.barrier()

    def _sync_ranks(self) -> bool:
        """Waits for this rank's queued work, then for every rank of the process group (a barrier).

        Returns:
            True.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._collectives.barrier()
        return True

    def _agree_max(self, value: int) -> int:
        """The largest `value` over the process group (an all-gather).

        Returns:
            the largest over the ranks.
        """
        return max(self._collectives.all_gather_object(int(value)))

    def destroy(self) -> None:
        """Every rank calls it (explicitly_destroy=True): leases end, then rank 0 deletes the group it created."""
        super().destroy()
        self._collectives.barrier()
        self._delete_group()

    def _delete_group(self) -> None:
        if self._owns_group is None:
            return
        socket, name, token = self._owns_group
        self._owns_group = None
        _OWNED_GROUPS.pop(name, None)
        Client(socket).delete_group(name, token)


@atexit.register
def _delete_created_groups():
    """At interpreter exit, rank 0 deletes the groups it created, whether or not its own Detach succeeded (a Detach
    that timed out must not leave the group's memory on every daemon)."""
    for buffer in list(_CREATED):
        try:
            buffer._release()
        except Exception:  # a Detach that failed or timed out: the lease ends with the connection or the group
            pass
    # Also the groups whose Buffer was collected before exit (its Detach ran then).
    for socket, name, token in list(_OWNED_GROUPS.values()):
        _OWNED_GROUPS.pop(name, None)
        try:
            Client(socket).delete_group(name, token)
        except Exception:  # the daemon may be gone already; the group then went with it
            pass


class ElasticBuffer(_elastic.ElasticBuffer):
    __doc__ = _elastic.ElasticBuffer.__doc__

    @staticmethod
    def get_buffer_size_hint(group: "dist.ProcessGroup", num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of region for these MoE settings, a multiple of 2 MiB: what normal mode needs over the hosts the
        daemons of `group` span (a collective over the group).

        Arguments:
            group: the process group.
            num_max_tokens_per_rank: the most tokens a rank dispatches.
            hidden: the hidden size.
            num_topk: the top-k (0: 8).
            use_fp8_dispatch: accepted (BF16's size covers FP8).
            allow_hybrid_mode: accepted.
            allow_multiple_reduction: accepted.

        Returns:
            size: bytes of each rank's region (2 MiB-aligned).
        """
        host_ids = _host_ids(group)
        hosts = _num_hosts(host_ids)
        return _elastic.buffer_size_hint(hosts, len(host_ids) // hosts, num_max_tokens_per_rank, hidden, num_topk)

    def _make_buffer(self, group: "dist.ProcessGroup", num_bytes: int, timeout_s: float) -> Buffer:
        """A normal-mode Buffer of this module with num_bytes of region (and of RDMA region across hosts)."""
        buffer = Buffer(group, num_nvl_bytes=num_bytes, num_rdma_bytes=num_bytes, explicitly_destroy=True)
        buffer._timeout_s = timeout_s  # the C Buffers are made at the first calls, with it
        return buffer


def get_physical_domain_size(group: "dist.ProcessGroup") -> Tuple[int, int]:
    """The hosts and ranks per host of `group` (the daemons' host ids; a collective over the group).

    Arguments:
        group: the process group.

    Returns:
        num_rdma_ranks: the hosts.
        num_nvlink_ranks: ranks per host.
    """
    host_ids = _host_ids(group)
    hosts = _num_hosts(host_ids)
    return hosts, len(host_ids) // hosts


def get_logical_domain_size(group: "dist.ProcessGroup", allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """DeepEP 2's logical domains of `group`: (hosts, ranks per host) with allow_hybrid_mode across hosts, else
    (1, ranks). A collective over the group.

    Arguments:
        group: the process group.
        allow_hybrid_mode: whether hybrid mode is allowed.

    Returns:
        num_scaleout_ranks: scale-out ranks.
        num_scaleup_ranks: scale-up ranks.
    """
    hosts, per_host = get_physical_domain_size(group)
    return _elastic.logical_domain_size(hosts * per_host, per_host, allow_hybrid_mode)


def _host_ids(group: "dist.ProcessGroup") -> List[str]:
    """The host id of every rank's daemon, in group-rank order."""
    collectives = collectives_for(group)
    client = Client(_socket_path(collectives.rank), client_name=f"deep_ep rank {collectives.rank}")
    try:
        return collectives.all_gather_object(client.host_id())
    finally:
        client.close()
