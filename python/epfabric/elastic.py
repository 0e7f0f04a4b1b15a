"""DeepEP 2's ElasticBuffer (deep_ep.ElasticBuffer, what vLLM's and SGLang's deepep_v2 backends call) over this
project's normal-mode kernels, through a Buffer of epfabric.deep_ep (the drop-in makes it; see ElasticBuffer there).

DeepEP 2 runs on NCCL's GPU-initiated networking (GIN) and symmetric memory; epfabric has neither, so its observable
behaviour is emulated (docs/python.md has the table):
- dispatch is a normal-mode dispatch (get_dispatch_layout + dispatch) and a cached dispatch of 8-column bf16 rows that
  carry each token's global index (source rank x num_max_tokens_per_rank + token) as base-256 digits; the received
  rows are then ordered by that index (so `deterministic` holds for every call), and DeepEP 2's handle fields, counts,
  prefix sums and the expanded layout are computed with torch on the receiving rank;
- combine sends, for each top-k slot, the value that slot has (one rank owns each slot, the others send zero) through
  a normal-mode combine, and the source adds the slots in DeepEP 2's order (within a scale-up domain first when
  hybrid), onto the bias: num_topk combines per call, bit for bit DeepEP 2's reference.
Pipeline-parallel send/recv, all-gather/reduce-scatter sessions and Engram need memory the daemons do not provide to
Python: those calls raise NotImplementedError naming the call.
"""
from typing import Any, List, Optional, Tuple, Union

import torch

from . import _elastic_layout as layout
from . import _words as words
from ._elastic_extras import ElasticExtrasMixin
from ._elastic_handle import EPHandle
from ._sizing import required_group_bytes
from .utils import EventHandle, EventOverlap

_Received = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
_ALIGNMENT = 2 << 20  # DeepEP 2's buffer sizes are multiples of 2 MiB


def _value_or(value: Any, default: Any) -> Any:
    return default if value is None else value


class ElasticBuffer(ElasticExtrasMixin):
    """DeepEP 2's ElasticBuffer: expert-parallel dispatch and combine over a process group, emulated on epfabric's
    normal mode (module docstring). Attributes as DeepEP's: group, rank_idx, num_ranks, allow_hybrid_mode,
    allow_multiple_reduction, prefer_overlap_with_compute, deterministic, num_bytes, num_max_tokens_per_rank,
    num_allocated_qps, explicitly_destroy, runtime (the epfabric.deep_ep.Buffer), num_scaleout_ranks,
    num_scaleup_ranks, scaleout_rank_idx, scaleup_rank_idx, num_rdma_ranks, num_nvlink_ranks.
    """

    def __init__(self, group: Any, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        """Creates the buffer on every rank of `group` (a collective, as DeepEP's).

        Arguments:
            group: the torch.distributed process group.
            num_bytes: bytes of each rank's region (and RDMA region across hosts); None: get_buffer_size_hint of the
                MoE settings below.
            num_cpu_bytes: must be 0 (DeepEP 2's host memory for Engram is not provided).
            num_max_tokens_per_rank: the most tokens a rank dispatches (the default of dispatch's).
            hidden: the hidden size (for the size hint).
            num_topk: the top-k (for the size hint; 0: 8).
            use_fp8_dispatch: accepted (the size hint is BF16's, which covers FP8).
            deterministic: accepted: received rows always come by source token.
            allow_hybrid_mode: across hosts, the scale-up domain is a host (logical domain sizes, combine's order).
            allow_multiple_reduction: expanded combine adds a rank's entries before sending.
            prefer_overlap_with_compute: accepted.
            sl_idx: accepted (RDMA service level: the daemons own the transport).
            num_allocated_qps: the queue pairs reported (none are used); 0: 17.
            num_cpu_timeout_secs: accepted (host waits are bounded by the library's timeouts).
            num_gpu_timeout_secs: the kernels' timeout.
            explicitly_destroy: destroy() must be called (every rank); else the resources go when collected.
        """
        if num_cpu_bytes:
            raise NotImplementedError(f"epfabric: num_cpu_bytes = {num_cpu_bytes}: DeepEP 2's host memory (Engram "
                                      "storage) is not provided; pass 0 (docs/python.md)")
        self.group = group
        self.rank_idx, self.num_ranks = group.rank(), group.size()
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        if num_bytes is None:
            if num_max_tokens_per_rank <= 0 or hidden <= 0:
                raise ValueError("ElasticBuffer: give num_bytes, or num_max_tokens_per_rank and hidden (the size "
                                 "hint's MoE settings)")
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                                  allow_hybrid_mode, allow_multiple_reduction)
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_allocated_qps = num_allocated_qps or 17
        self.explicitly_destroy = explicitly_destroy
        self.runtime = self._make_buffer(group, num_bytes, float(num_gpu_timeout_secs))
        self.num_nvlink_ranks = self.runtime.num_nvl_ranks
        self.num_rdma_ranks = self.num_ranks // self.num_nvlink_ranks
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks

    def _make_buffer(self, group: Any, num_bytes: int, timeout_s: float) -> Any:
        """The normal-mode Buffer the calls run on (epfabric.deep_ep.ElasticBuffer makes a deep_ep.Buffer)."""
        raise NotImplementedError("use epfabric.deep_ep.ElasticBuffer")

    def destroy(self) -> None:
        """Releases the buffer on every rank (a collective). Requires explicitly_destroy=True, as DeepEP's."""
        if not self.explicitly_destroy:
            raise RuntimeError("ElasticBuffer.destroy() needs explicitly_destroy=True at construction (as DeepEP's)")
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None

    # ---- size hints ----

    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of region for these MoE settings, a multiple of 2 MiB (epfabric.deep_ep.ElasticBuffer's asks the
        daemons how many hosts the group spans).

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
        raise NotImplementedError("use epfabric.deep_ep.ElasticBuffer")

    # ---- synchronization, streams, domains ----

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Every rank waits for the others, with its queued work finished first (emulated: the device synchronizes
        and the process group's barrier runs, which covers with_cpu_sync and sequential).

        Arguments:
            use_comm_stream: accepted (calls run on the current stream).
            with_cpu_sync: accepted (always synchronized).
            sequential: accepted.
        """
        self._live()._sync_ranks()

    @staticmethod
    def capture() -> EventHandle:
        """An event captured on the current stream.

        Returns:
            event_handle: the event (nothing to wait for on the host backend).
        """
        return EventHandle()

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """epfabric's kernels run on the caller's stream: this is the current stream.

        Returns:
            stream: the current CUDA stream, or None on the host backend.
        """
        return self._live().get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """The hosts and the ranks per host (the daemons' host ids).

        Returns:
            num_rdma_ranks: the hosts.
            num_nvlink_ranks: ranks per host.
        """
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """The scale-out and scale-up domain sizes: with allow_hybrid_mode across hosts (hosts, ranks per host), else
        (1, ranks).

        Returns:
            num_scaleout_ranks: scale-out ranks.
            num_scaleup_ranks: scale-up ranks.
        """
        return logical_domain_size(self.num_ranks, self.num_nvlink_ranks, self.allow_hybrid_mode)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """The SMs epfabric's normal mode uses (the Buffer's num_sms): dispatch and combine take any num_sms and
        record it in the handle, and run on these.

        Returns:
            num_sms: the SM count.
        """
        return self._live()._num_sms or type(self._live()).num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """Queue pairs for `num_sms` SMs, capped by num_allocated_qps (accepted by dispatch and combine; the
        daemons own the transport).

        Returns:
            num_qps: the count.
        """
        return min(num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9), self.num_allocated_qps)

    # ---- dispatch and combine ----

    def dispatch(self, x: _Received, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False
                 ) -> Tuple[_Received, Optional[torch.Tensor], Optional[torch.Tensor], EPHandle, EventOverlap]:
        """Sends each token to the ranks of its experts (DeepEP 2's dispatch). Every rank makes the same calls.

        Arguments:
            x: `[num_tokens, hidden]` with `torch.bfloat16`, or (`[num_tokens, hidden]` with `torch.float8_e4m3fn`,
                scales `[num_tokens, hidden / 128]` with `torch.float` or packed UE8M0 `torch.int`).
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, -1 for none; None with `handle`.
            topk_weights: `[num_tokens, num_topk]` with `torch.float` (with `handle`: new weights for its routing).
            cumulative_local_expert_recv_stats: `[num_local_experts]` with `torch.int`, added to: received entries
                per local expert.
            num_experts: the number of experts (from `handle` when cached).
            num_max_tokens_per_rank: default the constructor's (from `handle` when cached).
            expert_alignment: each local expert's rows rounded up to this (default 1).
            num_sms: recorded in the handle (the kernels use get_theoretical_num_sms' count).
            num_qps: accepted.
            previous_event: an event the call waits for first.
            previous_event_before_epilogue: waited for before the epilogue (here: with previous_event, first).
            async_with_compute_stream: return an event recorded after the call.
            allocate_on_comm_stream: accepted (outputs are allocated on the current stream).
            handle: a handle from an earlier dispatch: the same routing again.
            do_handle_copy: the handle keeps a copy of topk_idx.
            do_cpu_sync: False: DeepEP 2's worst-case row counts (the emulation still waits on the host);
                default True unless cached.
            do_expand: the expanded layout (one row per local expert a token chose, grouped by expert).
            do_zero_padding: accepted: alignment rows are always zero.
            use_tma_aligned_col_major_sf: received scales column-major with rows aligned to 4.

        Returns:
            recv_x: the received rows (by global source token index), as x.
            recv_topk_idx: `[num_recv_tokens, num_topk]`, local expert indices, -1 for others (None expanded).
            recv_topk_weights: `[num_recv_tokens, num_topk]` (expanded: `[num_expanded_tokens]`), None without
                weights.
            handle: the EPHandle (the given one when cached).
            event: the event after the call (async_with_compute_stream), else one that holds nothing.
        """
        runtime = self._live()
        data, scales = x if isinstance(x, tuple) else (x, None)
        for event in (previous_event, previous_event_before_epilogue):
            if event is not None:
                event.current_stream_wait()
        if handle is not None:
            recv_x, recv_scales, recv_w = self._cached_dispatch(runtime, x, topk_idx, topk_weights, num_experts,
                                                                num_max_tokens_per_rank, expert_alignment, do_cpu_sync,
                                                                do_expand, handle)
        else:
            handle, recv_x, recv_scales, recv_w = self._new_dispatch(
                runtime, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank, expert_alignment, num_sms,
                do_handle_copy, True if do_cpu_sync is None else do_cpu_sync, do_expand)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += handle.num_unaligned_recv_tokens_per_expert.to(
                cumulative_local_expert_recv_stats.device, cumulative_local_expert_recv_stats.dtype)
        recv_topk_idx = None if do_expand else handle._recv_topk_idx.clone()
        if do_expand:
            recv_x = layout.scatter_rows(recv_x, handle._slots, handle.num_expanded_tokens)
            if recv_scales is not None:
                recv_scales = layout.scatter_rows(recv_scales, handle._slots, handle.num_expanded_tokens)
            if recv_w is not None:
                picked = torch.where(handle._slots >= 0, recv_w, torch.zeros_like(recv_w))
                flat = torch.zeros(handle.num_expanded_tokens, dtype=recv_w.dtype, device=recv_w.device)
                flat[handle._slots[handle._slots >= 0].to(torch.int64)] = picked[handle._slots >= 0]
                recv_w = flat
        if recv_scales is not None and use_tma_aligned_col_major_sf:
            recv_scales = layout.tma_column_major(recv_scales)
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        return out_x, recv_topk_idx, recv_w, handle, self._event(async_with_compute_stream)

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Sends the rows back to their tokens' ranks and adds them there, without weights (DeepEP 2's combine).

        Arguments:
            x: `[num_recv_tokens, hidden]` (expanded: `[num_expanded_tokens, hidden]`) with `torch.bfloat16`, in
                dispatch's order.
            handle: the dispatch's handle.
            topk_weights: `[num_recv_tokens, num_topk]` (expanded: `[num_expanded_tokens]`) with `torch.float`,
                added up as the rows are.
            bias: 0, 1 or 2 `[num_tokens, hidden]` with `torch.bfloat16`, added to the result.
            num_sms: accepted.
            num_qps: accepted.
            previous_event: an event the call waits for first.
            previous_event_before_epilogue: waited for with previous_event.
            async_with_compute_stream: return an event recorded after the call.
            allocate_on_comm_stream: accepted.

        Returns:
            combined_x: `[num_tokens, hidden]` with `torch.bfloat16`, DeepEP 2's reduction order.
            combined_topk_weights: `[num_tokens, num_topk]` with `torch.float` (None without topk_weights).
            event: the event after the call (async_with_compute_stream).
        """
        runtime = self._live()
        for event in (previous_event, previous_event_before_epilogue):
            if event is not None:
                event.current_stream_wait()
        if not isinstance(handle, EPHandle) or handle._legacy is None:
            raise TypeError("handle must be the EPHandle that dispatch of this ElasticBuffer returned")
        recv_idx = handle._recv_topk_idx
        slots = handle._slots if handle.do_expand else None
        reduce_local = not handle.do_expand or self.allow_multiple_reduction
        parts = layout.SlotContributions(x, recv_idx, slots, reduce_local)
        weights = None
        if topk_weights is not None:
            zero = torch.zeros((), dtype=topk_weights.dtype, device=x.device)
            if handle.do_expand:
                safe = torch.where(slots >= 0, slots, torch.zeros_like(slots)).to(torch.int64)
                weights = torch.where(slots >= 0, topk_weights[safe], zero)
            else:
                weights = torch.where(recv_idx >= 0, topk_weights[:recv_idx.shape[0]], zero)
        combined_w = None
        slot_values: List[torch.Tensor] = []
        for j in range(recv_idx.shape[1]):
            if self.num_rdma_ranks > 1:
                # Normal-mode combines across hosts that follow each other with no dispatch in between return wrong
                # rows on the host backend (docs/python.md, "Known library defects"): a barrier before each.
                runtime._sync_ranks()
            w = self._to_legacy_order(handle, weights) if j == 0 and weights is not None else None
            out, out_w, _ = runtime.combine(self._to_legacy_order(handle, parts.slot(j)), handle._legacy,
                                            topk_weights=w)
            slot_values.append(out)
            if j == 0:
                combined_w = out_w
        hybrid = self.allow_hybrid_mode and self.num_scaleout_ranks > 1 and self.allow_multiple_reduction
        per_group = handle.num_experts // self.num_ranks * self.num_scaleup_ranks if hybrid else None
        bias_pair = bias if isinstance(bias, tuple) else (bias, None)
        combined_x = layout.reduce_slots(slot_values, handle.topk_idx, per_group, bias_pair)
        return combined_x, combined_w, self._event(async_with_compute_stream)

    # ---- internals ----

    def _live(self) -> Any:
        if self.runtime is None:
            raise RuntimeError("this ElasticBuffer was destroyed")
        return self.runtime

    def _event(self, async_with_compute_stream: bool) -> EventOverlap:
        return EventOverlap(EventHandle() if async_with_compute_stream else None)

    @staticmethod
    def _to_legacy_order(handle: EPHandle, rows: torch.Tensor) -> torch.Tensor:
        """Rows in received order (by global source index) back in the normal-mode dispatch's order."""
        out = torch.empty_like(rows)
        out[handle._order] = rows
        return out

    def _new_dispatch(self, runtime: Any, x: _Received, topk_idx: Optional[torch.Tensor],
                      topk_weights: Optional[torch.Tensor], num_experts: Optional[int], max_tokens: Optional[int],
                      alignment: Optional[int], num_sms: int, do_handle_copy: bool, do_cpu_sync: bool,
                      do_expand: bool) -> Tuple[EPHandle, torch.Tensor, Optional[torch.Tensor],
                                                Optional[torch.Tensor]]:
        data = x[0] if isinstance(x, tuple) else x
        if topk_idx is None or num_experts is None:
            raise ValueError("ElasticBuffer.dispatch: topk_idx and num_experts are required without a handle")
        max_tokens = _value_or(max_tokens, self.num_max_tokens_per_rank)
        alignment = _value_or(alignment, 1)
        num_tokens, topk = topk_idx.shape
        if num_tokens > max_tokens:
            raise ValueError(f"ElasticBuffer.dispatch: {num_tokens} tokens > num_max_tokens_per_rank = {max_tokens}")
        if alignment < 1:
            raise ValueError(f"expert_alignment = {alignment}: must be >= 1")
        worst = 0 if do_cpu_sync else self.num_ranks * max_tokens
        per_rank, _, per_expert, in_rank, _ = runtime.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, _, legacy, _ = runtime.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst)
        source = self.rank_idx * max_tokens + torch.arange(num_tokens, device=data.device, dtype=torch.int64)
        sent = runtime.dispatch(words.encode_words(source.unsqueeze(1)), handle=legacy)[0]
        recv_source = words.decode_words(sent, 1)[:, 0]
        valid = (recv_idx >= 0).any(1)
        order = torch.argsort(torch.where(valid, recv_source, torch.full_like(recv_source, 1 << 62)), stable=True)
        recv_source, recv_idx, valid = recv_source[order], recv_idx[order], valid[order]
        recv_x, recv_scales = (recv_x[0][order], recv_x[1][order]) if isinstance(recv_x, tuple) else (
            recv_x[order], None)
        recv_w = recv_w[order] if recv_w is not None else None
        num_local = num_experts // self.num_ranks
        counts = layout.local_counts(recv_idx, valid, num_local)
        aligned = (counts + alignment - 1) // alignment * alignment
        psum_expert = torch.cumsum(aligned, 0, dtype=torch.int32)
        source_rank = torch.div(recv_source[valid], max_tokens, rounding_mode="floor")
        per_source = torch.bincount(source_rank, minlength=self.num_ranks)[:self.num_ranks]
        per_scaleup = per_source.view(self.num_scaleout_ranks, self.num_scaleup_ranks).sum(0)
        rows = recv_idx.shape[0]
        positions = torch.arange(topk, device=recv_idx.device).expand(rows, topk)
        first = torch.where(recv_idx >= 0, positions, torch.full_like(positions, topk)).min(1).values
        metadata = torch.full((rows, 2 + topk), -1, dtype=torch.int32, device=recv_idx.device)
        metadata[:, 0] = torch.where(valid, recv_source, torch.full_like(recv_source, -1)).to(torch.int32)
        metadata[:, 1] = torch.where(valid, torch.div(recv_source, max_tokens, rounding_mode="floor") * topk + first,
                                     torch.full_like(recv_source, -1)).to(torch.int32)
        slots, num_expanded = None, 0
        if do_expand:
            slots = layout.expanded_slots(recv_idx, valid, counts, alignment)
            metadata[:, 2:] = slots
            psum_expert = (psum_expert - aligned + counts).to(torch.int32)
            if do_cpu_sync:
                num_expanded = int(aligned.sum())
            else:
                num_expanded = words.align(rows * min(topk, num_local) + (alignment - 1) * num_local, alignment)
        experts_per_rank = num_experts // self.num_ranks
        destination = torch.where(topk_idx >= 0, torch.div(topk_idx, experts_per_rank, rounding_mode="floor"),
                                  torch.full_like(topk_idx, -1)).to(torch.int32)
        handle = EPHandle(do_expand, num_experts, alignment, max_tokens, num_sms,
                          topk_idx.clone() if do_handle_copy else topk_idx,
                          int(valid.sum()) if do_cpu_sync else -1, num_expanded,
                          aligned.tolist() if do_cpu_sync else [],
                          torch.cumsum(per_scaleup, 0, dtype=torch.int32), psum_expert, counts, metadata,
                          destination, None, None)
        handle._legacy, handle._order, handle._recv_topk_idx = legacy, order, recv_idx
        handle._valid, handle._slots = valid, slots
        return handle, recv_x, recv_scales, recv_w

    def _cached_dispatch(self, runtime: Any, x: _Received, topk_idx: Optional[torch.Tensor],
                         topk_weights: Optional[torch.Tensor], num_experts: Optional[int],
                         max_tokens: Optional[int], alignment: Optional[int], do_cpu_sync: Optional[bool],
                         do_expand: bool,
                         handle: EPHandle) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        if not isinstance(handle, EPHandle) or handle._legacy is None:
            raise TypeError("handle must be an EPHandle that dispatch of this ElasticBuffer returned")
        if topk_idx is not None:
            raise ValueError("ElasticBuffer.dispatch: topk_idx must be None with a handle (its routing is reused)")
        if do_cpu_sync:
            raise ValueError("ElasticBuffer.dispatch: do_cpu_sync cannot be True with a cached handle (as DeepEP)")
        if do_expand != handle.do_expand:
            raise ValueError(f"ElasticBuffer.dispatch: do_expand = {do_expand}, the handle's dispatch had "
                             f"do_expand = {handle.do_expand}")
        given = (_value_or(num_experts, handle.num_experts), _value_or(alignment, handle.expert_alignment),
                 _value_or(max_tokens, handle.num_max_tokens_per_rank))
        if given != (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank):
            raise ValueError(f"ElasticBuffer.dispatch: (num_experts, expert_alignment, num_max_tokens_per_rank) = "
                             f"{given} differ from the handle's")
        recv = runtime.dispatch(x, handle=handle._legacy)[0]
        order = handle._order
        recv_x, recv_scales = (recv[0][order], recv[1][order]) if isinstance(recv, tuple) else (recv[order], None)
        recv_w = None
        if topk_weights is not None:
            rows = words.encode_words(words.float_words(topk_weights))
            got = runtime.dispatch(rows, handle=handle._legacy)[0][order]
            recv_w = words.words_float(words.decode_words(got, topk_weights.shape[1]))
        return recv_x, recv_scales, recv_w


def logical_domain_size(num_ranks: int, ranks_per_host: int, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """DeepEP 2's logical domains for a group of `num_ranks` ranks, `ranks_per_host` on each host.

    Returns:
        num_scaleout_ranks: hosts with allow_hybrid_mode (else 1).
        num_scaleup_ranks: ranks per host with allow_hybrid_mode (else all ranks).
    """
    hosts = num_ranks // ranks_per_host
    if allow_hybrid_mode and hosts > 1:
        return hosts, ranks_per_host
    return 1, num_ranks


def buffer_size_hint(num_hosts: int, ranks_per_host: int, num_max_tokens_per_rank: int, hidden: int,
                     num_topk: int) -> int:
    """get_buffer_size_hint for a group of `num_hosts` hosts of `ranks_per_host` ranks: the larger of the NVL and
    RDMA bytes normal mode needs (top-k 8 when 0, 256 experts rounded up to a multiple of the ranks, hidden at least
    the 8 columns of the emulation's side rows), 2 MiB-aligned."""
    ranks = num_hosts * ranks_per_host
    experts = words.align(256, ranks)
    nvl, rdma = required_group_bytes(max(num_max_tokens_per_rank, 1), max(words.align(hidden, 8), 8),
                                     num_topk or 8, experts, False, num_hosts, ranks_per_host)
    return words.align(max(nvl, rdma), _ALIGNMENT)
