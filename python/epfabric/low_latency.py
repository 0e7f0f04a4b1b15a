"""Low-latency dispatch/combine (decoding) of epfabric.Buffer, with DeepEP's names, parameters and return values."""
import ctypes
import warnings
from typing import Optional, Tuple, Union

import torch

from . import _lib, _tensors
from ._handles import Hook, LowLatencyHandle
from ._lib import call, lib
from ._sizing import _config, required_group_bytes
from ._tensors import describe, put
from .utils import EventOverlap

_BF16, _I64, _I32, _F32 = (torch.bfloat16,), (torch.int64,), (torch.int32,), (torch.float32,)
# Byte offsets of the descriptors in the argument and result structs (written and read in place, see buffer.py).
_LD_X, _LD_IDX, _LD_STATS = (getattr(_lib.LLDispatchArgs, n).offset for n in ("x", "topk_idx", "cumulative_stats"))
_LD_OUTPUTS = tuple(getattr(_lib.LLDispatchResult, n).offset for n in (
    "packed_recv_x", "packed_recv_x_scales", "packed_recv_count", "packed_recv_src_info", "packed_recv_layout_range"))
_LC_X, _LC_IDX, _LC_W, _LC_OUT = (getattr(_lib.LLCombineArgs, n).offset for n in ("x", "topk_idx", "topk_weights",
                                                                                  "out"))
_LCR_X = _lib.LLCombineResult.combined_x.offset
_LO_STATS = _lib.LLOptions.wait_recv_cost_stats.offset
_LL_DISPATCH, _LL_COMBINE = lib.epf_low_latency_dispatch_ex, lib.epf_low_latency_combine_ex


_logfmt_warned = False


def _warn_logfmt() -> None:
    """use_logfmt asks for DeepEP's lossy LogFMT-compressed combine (fewer bytes); epfabric runs the exact BF16 combine,
    whose result any LogFMT caller accepts, and says so once per process rather than refuse a server's setting."""
    global _logfmt_warned
    if not _logfmt_warned:
        _logfmt_warned = True
        warnings.warn("epfabric: low_latency_combine(use_logfmt=True) runs the exact BF16 combine (LogFMT compression "
                      "is not implemented; docs/python.md)", stacklevel=3)


class LowLatencyMixin:
    """Low latency of epfabric.Buffer (which provides the C Buffers, streams, events and the lease)."""

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], torch.Tensor,
                                        LowLatencyHandle, EventOverlap, Optional[Hook]]:
        """Sends each token to its experts' ranks, packed per local expert (DeepEP's low_latency_dispatch).

        Arguments:
            x: `[num_tokens, hidden]` with `torch.bfloat16`, num_tokens <= num_max_dispatch_tokens_per_rank.
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, -1 for no expert.
            num_max_dispatch_tokens_per_rank: the most tokens any rank dispatches (every rank passes the same).
            num_experts: the number of experts.
            cumulative_local_expert_recv_stats: `[num_local_experts]` with `torch.int`, added to: tokens each local
                expert received.
            dispatch_wait_recv_cost_stats: `[num_ranks]` with `torch.int64`, added to: per source rank, the
                nanoseconds the receive phase waited for its data (DeepEP counts clock cycles).
            use_fp8: cast to FP8 e4m3 with a scale per 128 channels.
            round_scale: round the scales to powers of two.
            use_ue8m0: scales as packed UE8M0 (with round_scale).
            async_finish: return an event recorded after the call (cuda).
            return_recv_hook: return after the send phase; the hook runs the receive phase.

        Returns:
            recv_x: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` with `torch.bfloat16`,
                or with use_fp8 (that data in FP8, scales `[.., .., hidden / 128]` token-minor as DeepEP's).
            recv_count: `[num_local_experts]` with `torch.int`, the rows each local expert received.
            handle: DeepEP's low-latency handle for combine.
            event: the event after the call (with async_finish on cuda).
            hook: the receive hook (return_recv_hook), else None.
        """
        if not self.low_latency_mode or self._lease is None:
            self._low_latency_only("low_latency_dispatch")
        calls, dev, index = self._calls, self.device, self._dev_index
        args = calls.ll_dispatch_args
        put(args, _LD_X, x, "x", _BF16, 2, dev, index)
        put(args, _LD_IDX, topk_idx, "topk_idx", _I64, 2, dev, index)
        put(args, _LD_STATS, cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", _I32, 1, dev,
            index, optional=True)
        self._put_wait_cost(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
        args.use_fp8, args.round_scale, args.use_ue8m0 = bool(use_fp8), bool(round_scale), bool(use_ue8m0)
        args.return_recv_hook = bool(return_recv_hook)
        hidden = x.shape[1]
        key = (num_max_dispatch_tokens_per_rank, hidden, topk_idx.shape[1], num_experts)
        if key != self._ll_key:
            self._ensure_low_latency(*key)
        result = calls.ll_dispatch_result
        status = _LL_DISPATCH(self._ll_cbuf, calls.ll_dispatch_args_ref, calls.ll_options_ref, self._stream(),
                              calls.ll_dispatch_result_ref)
        try:
            if status:
                raise _lib.fail(status, "epf_low_latency_dispatch_ex")
            wrap = self._alloc.wrap_at
            recv_x, scales, count, src_info, layout_range = (wrap(result, o) for o in _LD_OUTPUTS)
        finally:
            self._alloc.end_call()
        handle = LowLatencyHandle(ctypes.c_void_p(result.handle), src_info, layout_range,
                                  num_max_dispatch_tokens_per_rank, hidden, num_experts, x.shape[0], self._ll_serial,
                                  self._alloc)
        hook = Hook(self, result.hook) if result.hook else None
        if use_fp8:
            recv_x = (recv_x, scales.transpose(1, 2))  # stored [L, G, R*M]; DeepEP's [L, R*M, G] view of it
        return recv_x, count, handle, self._event(async_finish), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, EventOverlap, Optional[Hook]]:
        """Sends the experts' outputs back and adds them up weighted at each token's rank (DeepEP's
        low_latency_combine).

        Arguments:
            x: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` with `torch.bfloat16`.
            topk_idx: the dispatch's `topk_idx`.
            topk_weights: `[num_tokens, num_topk]` with `torch.float`, the weights.
            handle: the handle low_latency_dispatch returned.
            use_logfmt: DeepEP's LogFMT compression: the exact BF16 combine runs (with a warning, once).
            zero_copy: x is already in get_next_low_latency_combine_buffer's tensor.
            async_finish: return an event recorded after the call (cuda).
            return_recv_hook: return after the send phase; the hook runs the receive phase.
            out: `[num_tokens, hidden]` with `torch.bfloat16` to write into.
            combine_wait_recv_cost_stats: `[num_ranks]` with `torch.int64`, added to: per rank, the nanoseconds the
                receive phase waited for its partial rows.

        Returns:
            combined_x: `[num_tokens, hidden]` with `torch.bfloat16`.
            event: the event after the call (with async_finish on cuda).
            hook: the receive hook (return_recv_hook), else None.
        """
        if not self.low_latency_mode or self._lease is None:
            self._low_latency_only("low_latency_combine")
        if use_logfmt:
            _warn_logfmt()
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError("handle must be the handle that low_latency_dispatch returned")
        if handle._serial != self._ll_serial:
            raise ValueError("low_latency_combine: this handle came from a dispatch before the Buffer was set up again "
                             f"for another shape ({self._ll_cfg}); dispatch again and use the new handle")
        calls, dev, index = self._calls, self.device, self._dev_index
        args = calls.ll_combine_args
        put(args, _LC_X, None if zero_copy else x, "x", _BF16, 3, dev, index, optional=zero_copy)
        put(args, _LC_IDX, topk_idx, "topk_idx", _I64, 2, dev, index)
        put(args, _LC_W, topk_weights, "topk_weights", _F32, 2, dev, index)
        put(args, _LC_OUT, out, "out", _BF16, 2, dev, index, optional=True)
        self._put_wait_cost(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats")
        args.handle = handle._c
        args.zero_copy, args.return_recv_hook = bool(zero_copy), bool(return_recv_hook)
        result = calls.ll_combine_result
        status = _LL_COMBINE(self._ll_cbuf, calls.ll_combine_args_ref, calls.ll_options_ref, self._stream(),
                             calls.ll_combine_result_ref)
        try:
            if status:
                raise _lib.fail(status, "epf_low_latency_combine_ex")
            combined = out if out is not None else self._alloc.wrap_at(result, _LCR_X)
        finally:
            self._alloc.end_call()
        hook = Hook(self, result.hook) if result.hook else None
        return combined, self._event(async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """Where expert outputs go for a zero-copy combine.

        Arguments:
            handle: the handle of the dispatch whose outputs go there.

        Returns:
            buffer: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` with
                `torch.bfloat16`, inside this rank's region.
        """
        self._low_latency_only("get_next_low_latency_combine_buffer")
        d = _lib.Tensor()
        call("epf_next_low_latency_combine_buffer", self._ll_cbuf, ctypes.byref(d))
        nbytes = 2
        for i in range(d.ndim):
            nbytes *= d.shape[i]
        return _tensors.view_as(_tensors.from_pointer(d.data, nbytes, self.device), d)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks or unmasks a rank for the following low-latency calls, in stream order: nothing is sent to a masked
        rank, nothing awaited from it, its expert outputs count as zero. Needs a Buffer made with enable_shrink=True
        (as DeepEP's mask buffer does).

        Arguments:
            rank_to_mask: the group rank.
            mask: True masks it, False unmasks it.
        """
        table = self._rank_mask(update=True)
        if not 0 <= rank_to_mask < table.numel():
            raise ValueError(f"rank_to_mask = {rank_to_mask}: not a rank of this group (0..{table.numel() - 1})")
        table[rank_to_mask] = 1 if mask else 0

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes which ranks are masked (by the caller or after a timeout).

        Arguments:
            mask_status: `[num_ranks]` with `torch.int` on this Buffer's device: 1 for a masked rank, else 0.
        """
        table = self._rank_mask()
        describe(mask_status, "mask_status", (torch.int32,), 1, self.device)
        if mask_status.numel() != table.numel():
            raise ValueError(f"mask_status has {mask_status.numel()} entries: expected {table.numel()} (num_ranks)")
        mask_status.copy_((table != 0).to(torch.int32))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank (enable_shrink=True)."""
        self._rank_mask(update=True).zero_()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """epfabric's low-latency buffers need no cleaning between calls (monotonic signals, two halves), nor when
        normal-mode calls came in between (each mode has its own part of the region); this resets the low-latency
        Buffer as after a timeout, so every rank must call it with nothing in flight, as DeepEP's.

        Arguments:
            num_max_dispatch_tokens_per_rank: accepted (DeepEP's shape of the part to clean).
            hidden: accepted.
            num_experts: accepted.
        """
        self._low_latency_only("clean_low_latency_buffer")
        if self._ll_cbuf is not None:
            call("epf_buffer_reset", self._ll_cbuf, self._stream())

    # ---- internals ----

    def _put_wait_cost(self, stats, name):
        """DeepEP's wait-cost statistics (int64 [num_ranks], added to) into the options, or "not given"."""
        put(self._calls.ll_options, _LO_STATS, stats, name, _I64, 1, self.device, self._dev_index, optional=True)
        if stats is not None and stats.numel() != self.group_size:
            raise ValueError(f"{name} has {stats.numel()} entries: expected {self.group_size} (num_ranks)")

    def _rank_mask(self, update=False):
        """The mask as a tensor. Without enable_shrink it can be read (it stays all zero) but not written."""
        self._low_latency_only("the mask buffer")
        if update and not self._enable_shrink:
            raise RuntimeError("the mask buffer needs a Buffer made with enable_shrink=True (as in DeepEP); without it "
                               "a lost or silent rank fails the call instead of being masked")
        if self._ll_cbuf is None:
            raise RuntimeError("the mask buffer exists from the first low_latency_dispatch on (it sets the shape up)")
        d = _lib.Tensor()
        call("epf_low_latency_rank_mask", self._ll_cbuf, ctypes.byref(d))
        return _tensors.view_as(_tensors.from_pointer(d.data, 4 * d.shape[0], self.device), d)

    def _low_latency_only(self, what):
        if not self.low_latency_mode:
            raise RuntimeError(f"{what}: this group was created in normal mode; low-latency calls need a group "
                               "created with low_latency (docs/python.md)")
        if self._lease is None:
            raise RuntimeError("this Buffer was destroyed")

    def _ensure_low_latency(self, max_tokens: int, hidden: int, topk: int, num_experts: int) -> None:
        """Makes sure the low-latency C Buffer serves a call of this shape: the one there when it was set up for the
        same num_max_dispatch_tokens_per_rank, hidden size and experts and at least this top-k, else a new one
        (Buffer._renew: every rank replaces it at the same call) for this shape with the larger top-k of the two, or
        this call's top-k when only that fits. The outputs are shaped by the C Buffer's tokens and hidden size
        (DeepEP's packed [L, R*M, hidden]), so those are the call's own.

        Arguments:
            max_tokens: the call's num_max_dispatch_tokens_per_rank.
            hidden: the call's hidden size.
            topk: the call's top-k.
            num_experts: the call's number of experts.

        Raises:
            ValueError: the group's low-latency regions do not hold this shape, saying the bytes it needs and the
                bytes the group has.
        """
        cfg = self._ll_cfg
        same = cfg is not None and (cfg["max_tokens"], cfg["hidden"], cfg["num_experts"]) == (max_tokens, hidden,
                                                                                              num_experts)
        if same and topk <= cfg["topk"]:
            self._ll_key = (max_tokens, hidden, topk, num_experts)
            return
        hosts = self.group_size // self.num_nvl_ranks
        have = (self.num_nvl_bytes - self.num_normal_bytes, self.num_rdma_bytes - self.num_normal_rdma_bytes)
        topks = [topk] if cfg is None or cfg["topk"] <= topk else [cfg["topk"], topk]
        for chosen in topks:
            need = required_group_bytes(max_tokens, hidden, chosen, num_experts, True, hosts, self.num_nvl_ranks)
            if need[0] <= have[0] and need[1] <= have[1]:
                break
        else:
            raise ValueError(f"a low-latency call of {max_tokens} tokens per rank, hidden {hidden}, top-{topk}, "
                             f"{num_experts} experts needs {need[0]} NVL and {need[1]} RDMA bytes per rank; the group "
                             f"has {have[0]} NVL and {have[1]} RDMA bytes for low latency")
        key = {"max_tokens": max_tokens, "hidden": hidden, "topk": chosen, "num_experts": num_experts}
        config = _config(max_tokens, hidden, chosen, num_experts, 1, True, self._timeout_s)
        config.low_latency_sms = self._low_latency_sms
        self._ll_key = None
        self._renew("_ll_cbuf", config, key)
        self._ll_cfg = key
        self._ll_serial += 1
        self._ll_key = (max_tokens, hidden, topk, num_experts)
