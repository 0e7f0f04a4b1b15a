"""The handles that dispatch calls return (DeepEP's tuples, with the library's own record kept as attributes) and
the receive hook of low latency: owned C objects, released when collected.

Lifetime: a C handle frees its tensors through the allocator callbacks of the Buffer that made it (epfabric.h: the
allocator's functions must stay valid until its last handle is destroyed). So each handle keeps that allocator (the
owner of the ctypes callbacks) alive itself: it may be collected before or after its Buffer, after Buffer.destroy(),
and at interpreter exit in any order."""
import ctypes
from typing import Optional

import torch

from ._lib import call, lib


class UnavailableField:
    """A field of DeepEP's handle that this library does not hand out (docs/python.md says which and why): printing
    it names the field; any other use raises NotImplementedError saying so."""

    __slots__ = ("name", "reason")

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def __repr__(self) -> str:
        return f"<epfabric: {self.name} is not available: {self.reason}>"

    def _refuse(self, *_args, **_kwargs):
        raise NotImplementedError(f"epfabric: the handle's {self.name} is not available: {self.reason} "
                                  "(docs/python.md)")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._refuse()

    __getitem__ = __len__ = __iter__ = __bool__ = __int__ = __float__ = __index__ = _refuse


_NOT_EXPOSED = "the C library keeps it inside its dispatch handle and does not export it"
_INTRANODE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                     "is_token_in_rank", "send_head")
_INTERNODE_FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                     "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                     "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")


class DispatchHandle(tuple):
    """What dispatch returns for combine and cached dispatch: DeepEP's handle tuple, with the library's own record
    kept as attributes. Keep it until the combine.

    One host (DeepEP's intranode handle): (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    recv_src_idx, is_token_in_rank, send_head). Across hosts (DeepEP's internode handle): (is_token_in_rank,
    rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
    recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head).
    is_token_in_rank is the dispatch's tensor; rank_prefix_matrix is DeepEP's int32 [num_ranks, num_ranks]
    (`[i][j]` = tokens ranks 0..i send to rank j, the library's own, on the Buffer's device); across hosts the rows
    come by source rank as DeepEP's and recv_gbl_rank_prefix_sum (`[num_ranks]` int32, rows from ranks 0..i) says
    where each source's end; every other field is an UnavailableField (docs/python.md).

    Attributes:
        num_recv_tokens, num_tokens, hidden, topk: the dispatch's received rows, rows, hidden size and top-k.
    """

    def __new__(cls, c_handle: ctypes.c_void_p, num_recv_tokens: int, num_tokens: int, hidden: int, topk: int,
                is_token_in_rank: Optional[torch.Tensor] = None, rank_prefix_matrix: Optional[torch.Tensor] = None,
                internode: bool = False, serial: int = 0, recv_gbl_rank_prefix_sum: Optional[torch.Tensor] = None,
                order: Optional[torch.Tensor] = None, allocator: Optional[object] = None):
        known = {"is_token_in_rank": is_token_in_rank, "rank_prefix_matrix": rank_prefix_matrix,
                 "recv_gbl_rank_prefix_sum": recv_gbl_rank_prefix_sum}
        fields = []
        for name in (_INTERNODE_FIELDS if internode else _INTRANODE_FIELDS):
            value = known.get(name)
            if value is None:
                value = UnavailableField(name, _NOT_EXPOSED)
            fields.append(value)
        self = super().__new__(cls, fields)
        self._c = c_handle
        self._allocator = allocator  # the Buffer's _tensors.Allocator: the callbacks the C handle frees through
        self._serial = serial  # which C Buffer of its Buffer made it (Buffer._normal_serial)
        # Across hosts: the library's received row of each of DeepEP's rows (by source rank), or None (same order).
        self._order = order
        self.num_recv_tokens, self.num_tokens, self.hidden, self.topk = num_recv_tokens, num_tokens, hidden, topk
        return self

    def in_deep_ep_order(self, recv_gbl_rank_prefix_sum: torch.Tensor, order: torch.Tensor) -> "DispatchHandle":
        """This handle (across hosts) with DeepEP's recv_gbl_rank_prefix_sum and the rows' order; it takes over the
        library's handle (this one then holds none).

        Arguments:
            recv_gbl_rank_prefix_sum: `[num_ranks]` with `torch.int`, rows received from ranks 0..i.
            order: the library's received row of each row in DeepEP's order.

        Returns:
            handle: the new handle.
        """
        c_handle, self._c = self._c, None
        fields = dict(zip(_INTERNODE_FIELDS, self))
        return DispatchHandle(c_handle, self.num_recv_tokens, self.num_tokens, self.hidden, self.topk,
                              fields["is_token_in_rank"], None, True, self._serial, recv_gbl_rank_prefix_sum, order,
                              self._allocator)

    def __del__(self):
        if lib is not None and getattr(self, "_c", None):
            lib.epf_dispatch_handle_destroy(self._c)
            self._c = None


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle: (packed_recv_src_info, packed_recv_layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts), plus the library's record that combine needs."""

    def __new__(cls, c_handle: ctypes.c_void_p, src_info: torch.Tensor, layout_range: torch.Tensor, max_tokens: int,
                hidden: int, num_experts: int, num_tokens: int, serial: int = 0, allocator: Optional[object] = None):
        self = super().__new__(cls, (src_info, layout_range, max_tokens, hidden, num_experts))
        self._c = c_handle
        self._allocator = allocator  # as DispatchHandle's
        self._serial = serial  # which low-latency C Buffer of its Buffer made it (Buffer._ll_serial)
        self.num_tokens = num_tokens
        return self

    def __del__(self):
        if lib is not None and getattr(self, "_c", None):
            lib.epf_ll_handle_destroy(self._c)
            self._c = None


class Hook:
    """A receive hook (return_recv_hook=True): call it once, on the stream that should run the receive phase."""

    def __init__(self, buffer: "object", c_hook: int) -> None:
        self._buffer = buffer
        self._c = ctypes.c_void_p(c_hook)

    def __call__(self) -> None:
        if self._c is None:
            raise RuntimeError("this receive hook has already run")
        try:
            call("epf_hook_run", self._c, self._buffer._stream())
        finally:
            lib.epf_hook_destroy(self._c)
            self._c = None
            self._buffer._alloc.end_call()

    def __del__(self):
        if lib is not None and getattr(self, "_c", None) is not None:
            lib.epf_hook_destroy(self._c)
