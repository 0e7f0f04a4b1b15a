"""DeepEP 2's dispatch handle (EPHandle) as the ElasticBuffer emulation (elastic.py) fills it."""
from typing import Optional

import torch


class EPHandle:
    """DeepEP 2's dispatch handle (same attributes), plus the normal-mode handle and the received-row order that
    combine and cached dispatch use.

    Attributes:
        do_expand: whether the expanded layout was used.
        num_experts: the number of experts.
        expert_alignment: each local expert's received rows are rounded up to this.
        num_max_tokens_per_rank: the most tokens per rank (global token index = rank x this + token).
        num_sms: the SM count the dispatch was given (epfabric's kernels use the Buffer's).
        topk_idx: the dispatch's top-k indices (a copy with do_handle_copy).
        psum_num_recv_tokens_per_scaleup_rank: `[num_scaleup_ranks]`, inclusive prefix sum of the received tokens by
            source scale-up rank.
        psum_num_recv_tokens_per_expert: `[num_local_experts]`, prefix sum of the aligned counts (inclusive);
            expanded: the aligned sum of the experts before plus the expert's own (unaligned) count.
        num_recv_tokens_per_expert_list: aligned counts per local expert ([] without CPU sync).
        num_unaligned_recv_tokens_per_expert: `[num_local_experts]` with `torch.int`, the counts.
        recv_src_metadata: `[num_recv_tokens, 2 + num_topk]` with `torch.int`: the global source token index, source
            rank x num_topk + its first local slot, then (expanded) each slot's expanded row or -1.
        dst_buffer_slot_idx: `[num_tokens, num_topk]` with `torch.int`, the rank each top-k entry goes to (-1: none).
        token_metadata_at_forward, channel_linked_list: None (DeepEP 2's hybrid kernels only).
        num_recv_tokens: received tokens (-1 without CPU sync).
        num_expanded_tokens: rows of the expanded layout (0 when not expanded).
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list, psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor, num_unaligned_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor,
                 token_metadata_at_forward: Optional[torch.Tensor],
                 channel_linked_list: Optional[torch.Tensor]) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.cached_recv_src_metadata_before_sort = None
        # epfabric's: the normal-mode handle, the received rows' order (by global source index), the received
        # top-k indices in that order, which rows are received (not padding) and the expanded slots.
        self._legacy = None
        self._order: Optional[torch.Tensor] = None
        self._recv_topk_idx: Optional[torch.Tensor] = None
        self._valid: Optional[torch.Tensor] = None
        self._slots: Optional[torch.Tensor] = None

    def deterministic_sort(self, do_cpu_sync: bool, is_cached_dispatch: bool, recv_x: torch.Tensor,
                           recv_sf: Optional[torch.Tensor], recv_topk_idx: torch.Tensor,
                           recv_topk_weights: torch.Tensor, channel_linked_list: Optional[torch.Tensor]) -> None:
        """DeepEP 2 sorts the received rows by source token for deterministic=True. The emulation's rows already come
        in that order on every call, so there is nothing to do (the parameters are DeepEP's)."""
