"""Normal-mode (prefill, training) dispatch/combine of epfabric.Buffer, with DeepEP's names, parameters and return
values, across hosts too (DeepEP's internode_dispatch/internode_combine are the same calls)."""
import ctypes
from typing import List, Optional, Tuple, Union

import torch

from . import _lib
from . import _words as words
from ._calls import (_BF16, _BOOL, _CA_BIAS_0, _CA_BIAS_1, _CA_W, _CA_X, _COMBINE, _CR_W, _CR_X, _DA_IDX, _DA_SCALES,
                     _DA_W, _DA_X, _DISPATCH, _DISPATCH_OUTPUTS, _F32, _FP8_DATA, _GET_LAYOUT, _I32, _I64,
                     _LA_IN_RANK, _LA_INVALID, _LA_PER_EXPERT, _LA_PER_RANK, _LAYOUT_OFFSETS, _MAX_LOCAL_EXPERTS,
                     _SCALES)
from ._handles import DispatchHandle
from ._sizing import _config, _count, _max_tokens, required_group_bytes
from ._lib import call, lib
from ._tensors import put
from .utils import Config, EventOverlap


_Received = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


class NormalMixin:
    """Normal mode of epfabric.Buffer (which provides the C Buffers, streams, events and the lease)."""

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                                                            torch.Tensor, torch.Tensor, EventOverlap]:
        """Where each token goes, from its top-k experts (DeepEP's get_dispatch_layout).

        Arguments:
            topk_idx: `[num_tokens, num_topk]` with `torch.int64` (deep_ep.topk_idx_t), -1 for no expert.
            num_experts: the number of experts (a multiple of the ranks).
            previous_event: an event the call waits for first.
            async_finish: return an event recorded after the call (cuda) instead of nothing to wait for.
            allocate_on_comm_stream: accepted; outputs are allocated on the current stream (the one the call runs on).

        Returns:
            num_tokens_per_rank: `[num_ranks]` with `torch.int`, the tokens this rank sends to each rank.
            num_tokens_per_rdma_rank: across hosts `[num_hosts]` with `torch.int`, the tokens this rank sends to each
                host; None within one host (as DeepEP's).
            num_tokens_per_expert: `[num_experts]` with `torch.int`, the tokens this rank sends to each expert.
            is_token_in_rank: `[num_tokens, num_ranks]` with `torch.bool`, whether a token goes to a rank.
            event: the event after the call (with async_finish on cuda; else one that holds nothing).
        """
        self._normal_only("get_dispatch_layout")
        d = _lib.Tensor()
        put(d, 0, topk_idx, "topk_idx", _I64, 2, self.device, self._dev_index)
        self._wait(previous_event)
        cfg = self._cfg
        if cfg is None or num_experts != cfg["num_experts"] or topk_idx.shape[1] > cfg["topk"]:
            # No C Buffer yet (its hidden size is known at the first dispatch), or one set up for another shape (the
            # dispatch with this layout makes the new one): computed here, with torch.
            self._release_layout()
            per_rank, per_expert, in_rank = _torch_layout(topk_idx, num_experts, self.group_size)
            return per_rank, self._per_host(in_rank), per_expert, in_rank, self._event(async_finish)
        layout = _lib.Layout()
        status = _GET_LAYOUT(self._cbuf, ctypes.byref(d), self._stream(), ctypes.byref(layout))
        try:
            if status:
                raise _lib.fail(status, "epf_get_dispatch_layout")
            wrap = self._alloc.wrap_at
            per_rank, per_expert, in_rank = (wrap(layout, o) for o in _LAYOUT_OFFSETS[:3])
        finally:
            self._alloc.end_call()
        self._release_layout()
        self._last_layout = (layout, in_rank.data_ptr() if in_rank.numel() else None)
        return per_rank, self._per_host(in_rank), per_expert, in_rank, self._event(async_finish)

    def dispatch(self, x: _Received, handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> Tuple[_Received, Optional[torch.Tensor],
                                                                 Optional[torch.Tensor], Optional[List[int]],
                                                                 Optional[DispatchHandle], EventOverlap]:
        """Sends each token to the ranks of its experts (DeepEP's dispatch, within a host or across hosts).

        Arguments:
            x: `[num_tokens, hidden]` with `torch.bfloat16`, or (`[num_tokens, hidden]` with `torch.float8_e4m3fn`,
                scales `[num_tokens, hidden / 128]` with `torch.float` or `[num_tokens, hidden / 512]` with
                `torch.int` (packed UE8M0)).
            handle: a handle from an earlier dispatch of this Buffer (cached dispatch: the same routing, no layout).
            num_tokens_per_rank: get_dispatch_layout's; required unless cached.
            num_tokens_per_rdma_rank: accepted (None from get_dispatch_layout); not needed.
            is_token_in_rank: get_dispatch_layout's; required unless cached.
            num_tokens_per_expert: get_dispatch_layout's; required unless cached.
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, -1 for no expert.
            topk_weights: `[num_tokens, num_topk]` with `torch.float`.
            expert_alignment: each local expert's count in num_recv_tokens_per_expert_list is rounded up to this.
            num_worst_tokens: > 0: nothing waits on the host (CUDA-graph capturable), every output has this many rows,
                rows past the received ones have top-k index -1 and weight 0.
            config: the SMs (channels) to use; None: the Buffer's.
            previous_event: an event the call waits for first.
            async_finish: return an event recorded after the call (cuda).
            allocate_on_comm_stream: accepted; outputs are allocated on the current stream.

        Returns:
            recv_x: the received rows, by source rank (as DeepEP's; across hosts the library's order is permuted
                into it), as x: a tensor, or (data, scales) with the scales' dtype.
            recv_topk_idx: `[num_recv_tokens, num_topk]`, local expert indices, -1 for experts of other ranks
                (None when cached).
            recv_topk_weights: the received weights (None when cached).
            num_recv_tokens_per_expert_list: tokens each local expert receives, rounded up to expert_alignment ([]
                with num_worst_tokens; None when cached).
            handle: DeepEP's handle tuple for combine and cached dispatch (None when cached, as DeepEP's).
            event: the event after the call (with async_finish on cuda).
        """
        self._normal_only("dispatch")
        if type(num_worst_tokens) is not int or num_worst_tokens < 0:
            num_worst_tokens = _count("num_worst_tokens", num_worst_tokens)
        calls, dev, index = self._calls, self.device, self._dev_index
        args = calls.dispatch_args
        fp8 = isinstance(x, tuple)
        data, scales = x if fp8 else (x, None)
        put(args, _DA_X, data, "x[0]" if fp8 else "x", _FP8_DATA if fp8 else _BF16, 2, dev, index)
        if fp8 and scales is not None and scales.dim() == 2 and not scales.is_contiguous():
            scales = scales.contiguous()  # DeepEP accepts column-major scales; the kernels read row-major
        # float32 [tokens, hidden / 128], or DeepEP's packed UE8M0 int32 [tokens, hidden / 512]
        put(args, _DA_SCALES, scales, "x[1] (scales)", _SCALES, 2, dev, index, optional=not fp8)
        put(args, _DA_IDX, topk_idx, "topk_idx", _I64, 2, dev, index, optional=True)
        put(args, _DA_W, topk_weights, "topk_weights", _F32, 2, dev, index, optional=True)
        args.expert_alignment = int(expert_alignment)
        num_tokens, hidden = data.shape
        if handle is not None:
            if not isinstance(handle, DispatchHandle):
                raise TypeError("handle must be the DispatchHandle an earlier dispatch of this Buffer returned")
            self._check_handle(handle, "dispatch")
            if hidden > self._cfg["hidden"]:
                raise ValueError(f"hidden = {hidden}: a cached dispatch runs on the Buffer its handle came from, set "
                                 f"up for hidden <= {self._cfg['hidden']}; dispatch without the handle")
            args.cached = handle._c
            args.layout = None
            topk = handle.topk
        else:
            for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert)):
                if t is None:
                    raise ValueError(f"{name} is required unless handle is given (cached dispatch)")
            topk = topk_idx.shape[1] if topk_idx is not None else 1
            self._ensure_normal(hidden, topk, num_tokens_per_expert.numel(), num_tokens, config)
            layout = calls.layout
            put(layout, _LA_PER_RANK, num_tokens_per_rank, "num_tokens_per_rank", _I32, 1, dev, index)
            put(layout, _LA_PER_EXPERT, num_tokens_per_expert, "num_tokens_per_expert", _I32, 1, dev, index)
            put(layout, _LA_IN_RANK, is_token_in_rank, "is_token_in_rank", _BOOL, 2, dev, index)
            last = self._last_layout
            if last is not None and last[1] == is_token_in_rank.data_ptr():
                layout.num_invalid_topk = last[0].num_invalid_topk
            else:
                put(layout, _LA_INVALID, None, "", (), 0, dev, index, optional=True)
            args.cached = None
            args.layout = calls.layout_pointer
        self._wait(previous_event)
        calls.dispatch_options.num_worst_tokens = num_worst_tokens
        result = calls.dispatch_result
        status = _DISPATCH(self._cbuf, calls.dispatch_args_ref, calls.dispatch_options_ref, self._stream(),
                           calls.dispatch_result_ref)
        try:
            if status:
                raise _lib.fail(status, "epf_dispatch_ex")
            wrap = self._alloc.wrap_at
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights = (wrap(result, o) for o in _DISPATCH_OUTPUTS)
        finally:
            self._alloc.end_call()
        if handle is None:
            internode = self.group_size != self.num_nvl_ranks
            new_handle = DispatchHandle(ctypes.c_void_p(result.handle), result.num_recv_tokens, num_tokens, hidden,
                                        topk, is_token_in_rank, self._handle_prefix_matrix(result.handle),
                                        internode, self._normal_serial, allocator=self._alloc)
            per_expert = calls.counts[:min(result.num_local_experts, _MAX_LOCAL_EXPERTS)]
            if internode and recv_topk_idx is not None:
                new_handle = self._deep_ep_order(new_handle, recv_topk_idx, num_tokens, data.device)
                order = new_handle._order
                recv_x, recv_topk_idx = recv_x[order], recv_topk_idx[order]
                recv_scales = recv_scales[order] if recv_scales is not None else None
                recv_topk_weights = recv_topk_weights[order] if recv_topk_weights is not None else None
        else:  # the cached handle stays the handle; DeepEP's cached dispatch returns only the rows
            lib.epf_dispatch_handle_destroy(ctypes.c_void_p(result.handle))
            if handle._order is not None:
                recv_x = recv_x[handle._order]
                recv_scales = recv_scales[handle._order] if recv_scales is not None else None
            out_x = (recv_x, recv_scales) if fp8 else recv_x
            return out_x, None, None, None, None, self._event(async_finish)
        out_x = (recv_x, recv_scales) if fp8 else recv_x
        return out_x, recv_topk_idx, recv_topk_weights, per_expert, new_handle, self._event(async_finish)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Sends each received row back to its source and adds them up there, without weights (DeepEP's combine).

        Arguments:
            x: `[num_recv_tokens, hidden]` with `torch.bfloat16`, the rows to send back (dispatch's order).
            handle: the handle that dispatch returned.
            topk_weights: `[num_recv_tokens, num_topk]` with `torch.float`, added up as the rows are.
            bias: 0, 1 or 2 `[num_tokens, hidden]` with `torch.bfloat16`, added to the result.
            config: accepted; combine uses the handle's C Buffer.
            previous_event: an event the call waits for first.
            async_finish: return an event recorded after the call (cuda).
            allocate_on_comm_stream: accepted; outputs are allocated on the current stream.

        Returns:
            combined_x: `[num_tokens, hidden]` with `torch.bfloat16`, the sum over the ranks of each token.
            combined_topk_weights: the sum of the weights (None without topk_weights).
            event: the event after the call (with async_finish on cuda).
        """
        self._normal_only("combine")
        if not isinstance(handle, DispatchHandle):
            raise TypeError("handle must be the DispatchHandle that dispatch returned")
        self._check_handle(handle, "combine")
        if handle._order is not None:  # back to the library's received order
            x = _unpermute(x, handle._order)
            topk_weights = _unpermute(topk_weights, handle._order) if topk_weights is not None else None
        calls, dev, index = self._calls, self.device, self._dev_index
        args = calls.combine_args
        put(args, _CA_X, x, "x", _BF16, 2, dev, index)
        put(args, _CA_W, topk_weights, "topk_weights", _F32, 2, dev, index, optional=True)
        bias_0, bias_1 = bias if isinstance(bias, tuple) else (bias, None)
        put(args, _CA_BIAS_0, bias_0, "bias[0]", _BF16, 2, dev, index, optional=True)
        put(args, _CA_BIAS_1, bias_1, "bias[1]", _BF16, 2, dev, index, optional=True)
        args.handle = handle._c
        self._wait(previous_event)
        result = calls.combine_result
        status = _COMBINE(self._cbuf, calls.combine_args_ref, self._stream(), calls.combine_result_ref)
        try:
            if status:
                raise _lib.fail(status, "epf_combine")
            combined_x = self._alloc.wrap_at(result, _CR_X)
            combined_w = self._alloc.wrap_at(result, _CR_W)
        finally:
            self._alloc.end_call()
        return combined_x, combined_w, self._event(async_finish)

    def internode_dispatch(self, x: _Received, handle: Optional[DispatchHandle] = None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False) -> Tuple[_Received, Optional[torch.Tensor],
                                                                           Optional[torch.Tensor],
                                                                           Optional[List[int]],
                                                                           Optional[DispatchHandle], EventOverlap]:
        """DeepEP's internode dispatch, which its dispatch calls for groups across hosts: the same call as dispatch
        (the Buffer takes the internode path when its group spans hosts). Arguments and returns: see dispatch.
        """
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                             previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                          bias: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
                          config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False
                          ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """DeepEP's internode combine: the same call as combine. Arguments and returns: see combine."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    def _per_host(self, is_token_in_rank: torch.Tensor) -> Optional[torch.Tensor]:
        """DeepEP's num_tokens_per_rdma_rank: tokens that go to any rank of each host; None within one host."""
        if self.group_size == self.num_nvl_ranks:
            return None
        hosts = self.group_size // self.num_nvl_ranks
        return is_token_in_rank.view(-1, hosts, self.num_nvl_ranks).any(2).sum(0, dtype=torch.int32)

    def _deep_ep_order(self, handle: DispatchHandle, recv_topk_idx: torch.Tensor, num_tokens: int,
                       device: torch.device) -> DispatchHandle:
        """DeepEP's order of the rows a dispatch across hosts received: by source rank, each source's rows in token
        order (the library's internode path delivers them by the source's index within its host, then its host). A
        cached dispatch of 8-column rows carrying this rank's index tells each received row's source; the rows past
        the received ones (num_worst_tokens) stay last. Only device work: capturable into CUDA graphs.

        Arguments:
            handle: the dispatch's handle (its rows in the library's order).
            recv_topk_idx: the dispatch's received top-k indices (-1 everywhere on padding rows).
            num_tokens: the dispatch's tokens.
            device: where they are.

        Returns:
            handle: the handle with recv_gbl_rank_prefix_sum and the order (it takes over the library's handle).
        """
        rows = words.encode_words(torch.full((num_tokens, 1), self.rank, dtype=torch.int64, device=device))
        sources = words.decode_words(self.dispatch(rows, handle=handle)[0], 1)[:, 0]
        valid = (recv_topk_idx >= 0).any(1)
        sources = torch.where(valid, sources, torch.full_like(sources, self.group_size))
        order = torch.argsort(sources, stable=True)
        counts = torch.zeros(self.group_size + 1, dtype=torch.int32, device=device)
        counts.scatter_add_(0, sources, torch.ones_like(sources, dtype=torch.int32))
        return handle.in_deep_ep_order(torch.cumsum(counts[:self.group_size], 0, dtype=torch.int32), order)

    def _handle_prefix_matrix(self, c_handle: int) -> Optional[torch.Tensor]:
        """DeepEP's rank_prefix_matrix of a dispatch within one host (int32 [num_ranks, num_ranks], the handle's
        memory, written by the dispatch in stream order); None across hosts, whose DeepEP handle has none."""
        if self.group_size != self.num_nvl_ranks:
            return None
        d = _lib.Tensor()
        call("epf_dispatch_handle_rank_prefix_matrix", ctypes.c_void_p(c_handle), ctypes.byref(d))
        return self._alloc.wrap(d)

    def _release_layout(self) -> None:
        if self._last_layout is not None:
            lib.epf_layout_release(ctypes.byref(self._last_layout[0]))
            self._last_layout = None

    def _normal_only(self, what: str) -> None:
        if not self.normal_mode:
            raise RuntimeError(f"{what}: this group was created in low-latency mode without a normal-mode part; "
                               "normal dispatch/combine need a group created without low_latency, or with "
                               "num_normal_bytes (docs/python.md)")

    def _normal_fit(self, hidden: int, topk: int, num_experts: int, num_sms: int,
                    num_tokens: int) -> Optional["_lib.BufferConfig"]:
        """The C Buffer configuration for normal mode of this shape, with the most tokens per rank the group's regions
        hold, or None when they hold fewer than `num_tokens` (or none)."""
        hosts = self.group_size // self.num_nvl_ranks
        c = _config(1, hidden, max(topk, 1), num_experts, num_sms, False, self._timeout_s)
        nvl_bytes, rdma_bytes = self._normal_region_bytes()
        c.max_tokens_per_rank = _max_tokens(c, hosts, self.num_nvl_ranks, nvl_bytes, rdma_bytes)
        return c if c.max_tokens_per_rank >= max(num_tokens, 1) else None

    def _normal_region_bytes(self) -> Tuple[int, int]:
        """(NVL bytes, RDMA bytes) of the group's regions that normal mode has."""
        if self.low_latency_mode:
            return self.num_normal_bytes, self.num_normal_rdma_bytes
        return self.num_nvl_bytes, self.num_rdma_bytes

    def _ensure_normal(self, hidden: int, topk: int, num_experts: int, num_tokens: int,
                       config: Optional[Config]) -> None:
        """Makes sure the normal-mode C Buffer serves a dispatch of this shape: the one there when it serves the shape
        (hidden and top-k up to its own, the same experts), else a new one (_renew) for a shape that covers both (the
        larger hidden size and top-k) when the group's regions hold it with the tokens of every rank, else for this
        call's shape alone. The SM count (channels) is fixed when a C Buffer is made: a call whose Config asks for
        another count runs on the C Buffer there (DeepEP's callers tune num_sms call by call; making a C Buffer
        synchronizes every rank).

        Every rank makes the same decisions by construction: whether to replace the C Buffer depends only on the shape
        (which DeepEP's callers keep the same on every rank) and on the group's sizes (epf_lease_group_bytes, the same
        on every rank and backend), never on this rank's token count or on how large its mapping happens to be. The
        new C Buffer's shape is chosen from the most tokens any rank has in this call (_agree_max), so every rank
        makes the same one, or every rank refuses.

        Arguments:
            hidden: the call's hidden size.
            topk: the call's top-k (1 without top-k).
            num_experts: the call's number of experts.
            num_tokens: the call's tokens.
            config: the call's Config (its num_sms for a new C Buffer), or None for the Buffer's.

        Raises:
            ValueError: the group's regions hold no C Buffer for this call, or the C Buffer there (which serves the
                shape) holds fewer tokens per rank than this call has, saying the bytes it needs and the bytes the
                group has. Nothing is replaced and nothing is launched.
        """
        key = (hidden, topk, num_experts)
        cfg = self._cfg
        if cfg is not None and (key == self._normal_key or (hidden <= cfg["hidden"] and topk <= cfg["topk"]
                                                            and num_experts == cfg["num_experts"])):
            if num_tokens > cfg["max_tokens"]:  # this rank's input: refused here, before anything is launched
                self._refuse_tokens(num_tokens, hidden, topk, num_experts, cfg["num_sms"],
                                    f"this Buffer's C Buffer (set up for {cfg}) holds at most {cfg['max_tokens']} "
                                    "tokens per rank")
            self._normal_key = key
            return
        num_sms = config.num_sms if config is not None else (self._num_sms or type(self).num_sms)
        most_tokens = self._agree_max(num_tokens)
        candidates = [(hidden, max(topk, 1))]
        if cfg is not None:
            candidates.insert(0, (max(hidden, cfg["hidden"]), max(topk, cfg["topk"])))
        for cover_hidden, cover_topk in candidates:
            c = self._normal_fit(cover_hidden, cover_topk, num_experts, num_sms, most_tokens)
            if c is not None:
                break
        else:
            self._refuse_tokens(most_tokens, hidden, topk, num_experts, num_sms, "")
        shape = {"hidden": c.hidden, "topk": c.max_topk, "num_experts": num_experts, "num_sms": num_sms,
                 "max_tokens": c.max_tokens_per_rank}
        self._normal_key = None
        self._renew("_cbuf", c, shape)
        self._cfg = shape
        self._normal_serial += 1
        self._normal_key = key

    def _refuse_tokens(self, num_tokens: int, hidden: int, topk: int, num_experts: int, num_sms: int,
                       why: str) -> None:
        """Raises the ValueError of a dispatch that the group's regions (or the C Buffer there) do not hold."""
        hosts = self.group_size // self.num_nvl_ranks
        need = required_group_bytes(max(num_tokens, 1), hidden, max(topk, 1), num_experts, False, hosts,
                                    self.num_nvl_ranks, num_sms)
        have = self._normal_region_bytes()
        raise ValueError(f"a dispatch of {num_tokens} tokens of hidden {hidden}, top-{topk}, {num_experts} experts, "
                         f"{num_sms} SMs needs {need[0]} NVL and {need[1]} RDMA bytes per rank; the group has "
                         f"{have[0]} NVL and {have[1]} RDMA bytes for normal mode" + (f" ({why})" if why else ""))

    def _check_handle(self, handle: "DispatchHandle", what: str) -> None:
        """A handle from a C Buffer that has since been replaced (another shape) is refused."""
        if handle._serial != self._normal_serial:
            raise ValueError(f"{what}: this handle came from a dispatch before the Buffer was set up again for "
                             f"another shape ({self._cfg}); dispatch again and use the new handle")


def _unpermute(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows in DeepEP's order back in the library's (the inverse of rows = library_rows[order])."""
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def _torch_layout(topk_idx: torch.Tensor, num_experts: int,
                  num_ranks: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dispatch layout computed with torch (the first call of a Buffer, before its hidden size is known)."""
    if num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"num_experts = {num_experts}: must be a positive multiple of the number of ranks "
                         f"({num_ranks})")
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        raise ValueError(f"topk_idx has {int(bad.sum())} entries outside [-1, {num_experts})")
    num_tokens = topk_idx.shape[0]
    valid = topk_idx >= 0
    per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    rank_of = torch.where(valid, topk_idx // (num_experts // num_ranks), torch.full_like(topk_idx, num_ranks))
    in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    in_rank.scatter_(1, rank_of, True)
    in_rank = in_rank[:, :num_ranks].contiguous()
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank
