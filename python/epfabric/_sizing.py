"""Group and C Buffer sizes: what a configuration needs (RequiredGroupBytes), the most tokens a region holds, and
the shapes get_low_latency_rdma_size_hint returned sizes for."""
import ctypes
import operator
from typing import Dict, Optional, Tuple

from . import _lib
from ._lib import call, lib


def _count(name: str, value: object) -> int:
    """An int >= 0 (a Python or numpy int): ValueError/TypeError naming `name` otherwise."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} = {value}: must be >= 0")
    return value


def _config(max_tokens: int, hidden: int, topk: int, num_experts: int, num_sms: int, low_latency: bool,
            timeout_s: float) -> "_lib.BufferConfig":
    c = _lib.BufferConfig()
    c.max_tokens_per_rank, c.hidden, c.max_topk, c.num_experts = max_tokens, hidden, topk, num_experts
    c.num_sms, c.low_latency, c.timeout_s = num_sms, int(low_latency), timeout_s
    return c


# get_low_latency_rdma_size_hint's results in this process: bytes -> (max tokens per rank, hidden, ranks, experts).
_HINTED_SHAPES: Dict[int, Tuple[int, int, int, int]] = {}


def low_latency_shape_of(hint_bytes: int, num_ranks: Optional[int] = None) -> Optional[Tuple[int, int, int, int]]:
    """The (max tokens per rank, hidden, ranks, experts) that get_low_latency_rdma_size_hint returned `hint_bytes`
    for in this process, or None. With `num_ranks`, a size that is not a hint itself (DeepEP's callers pass the larger
    of the normal-mode and the low-latency sizes) gives the largest hinted shape of that many ranks that fits in it."""
    shape = _HINTED_SHAPES.get(hint_bytes)
    if num_ranks is None or (shape is not None and shape[2] == num_ranks):
        return shape
    fitting = [(hint, shape) for hint, shape in _HINTED_SHAPES.items() if shape[2] == num_ranks and hint <= hint_bytes]
    return max(fitting)[1] if fitting else None


def required_group_bytes(max_tokens_per_rank: int, hidden: int, topk: int, num_experts: int, low_latency: bool,
                         num_hosts: int, ranks_per_host: int, num_sms: int = 20) -> Tuple[int, int]:
    """The bytes a group needs for this configuration (the daemon's RequiredGroupBytes).

    Arguments:
        max_tokens_per_rank: the most tokens a rank sends in one call.
        hidden: the hidden size.
        topk: the most experts per token.
        num_experts: the number of experts.
        low_latency: low latency (else normal mode).
        num_hosts: the hosts the group spans.
        ranks_per_host: ranks on each host.
        num_sms: normal mode's SMs (channels).

    Returns:
        num_nvl_bytes: bytes of each rank's NVL region.
        num_rdma_bytes: bytes of each rank's RDMA region (0 within one host).
    """
    c = _config(max_tokens_per_rank, hidden, topk, num_experts, num_sms, low_latency, 5.0)
    nvl, rdma = ctypes.c_uint64(), ctypes.c_uint64()
    call("epf_required_group_bytes", ctypes.byref(c), num_hosts, ranks_per_host, ctypes.byref(nvl), ctypes.byref(rdma))
    return nvl.value, rdma.value


def _fits(c: "_lib.BufferConfig", hosts: int, ranks_per_host: int, nvl_bytes: int, rdma_bytes: int) -> bool:
    nvl, rdma = ctypes.c_uint64(), ctypes.c_uint64()
    if lib.epf_required_group_bytes(ctypes.byref(c), hosts, ranks_per_host, ctypes.byref(nvl), ctypes.byref(rdma)):
        return False
    return nvl.value <= nvl_bytes and rdma.value <= rdma_bytes


def _max_tokens(c: "_lib.BufferConfig", hosts: int, ranks_per_host: int, nvl_bytes: int, rdma_bytes: int) -> int:
    """The most tokens per rank the group's regions hold for this hidden size, top-k and expert count (0: none)."""
    c.max_tokens_per_rank = 1
    if not _fits(c, hosts, ranks_per_host, nvl_bytes, rdma_bytes):
        return 0
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        c.max_tokens_per_rank = mid
        if _fits(c, hosts, ranks_per_host, nvl_bytes, rdma_bytes):
            lo = mid
        else:
            hi = mid - 1
    return lo
