"""Torch helpers of the ElasticBuffer emulation (elastic.py): the side rows that carry source indices and weights
through a cached normal-mode dispatch, DeepEP 2's received layouts (rows by source token, the expanded layout with
each local expert's rows aligned), and the combine's reduction in DeepEP 2's order."""
from typing import List, Optional, Tuple

import torch

from ._words import align


def local_counts(recv_topk_idx: torch.Tensor, valid: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """`[num_local_experts]` with `torch.int`: the received entries of each local expert."""
    entries = recv_topk_idx[valid]
    entries = entries[entries >= 0]
    return torch.bincount(entries, minlength=num_local_experts)[:num_local_experts].to(torch.int32)


def expanded_slots(recv_topk_idx: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor,
                   alignment: int) -> torch.Tensor:
    """DeepEP 2's expanded layout: local expert e's rows start at the aligned sum of the experts before it, each
    received token once per local expert it chose, in received-row order (rows come by source token).

    Arguments:
        recv_topk_idx: `[num_rows, num_topk]`, local expert indices, -1 for none.
        valid: `[num_rows]` with `torch.bool`, the received rows (the rest is padding).
        counts: local_counts' result.
        alignment: each expert's rows are rounded up to this.

    Returns:
        slots: `[num_rows, num_topk]` with `torch.int`, the expanded row of each entry, -1 for none.
    """
    num_rows, topk = recv_topk_idx.shape
    mask = (recv_topk_idx >= 0) & valid.unsqueeze(1)
    experts = torch.where(mask, recv_topk_idx, torch.full_like(recv_topk_idx, counts.numel()))
    rows = torch.arange(num_rows, device=recv_topk_idx.device).unsqueeze(1).expand(num_rows, topk)
    key = (experts * max(num_rows, 1) + rows).flatten()
    order = torch.argsort(key, stable=True)
    num_entries = int(mask.sum())
    chosen = order[:num_entries]
    expert_of = experts.flatten()[chosen]
    aligned = (counts.to(torch.int64) + alignment - 1) // alignment * alignment
    aligned_start = torch.cumsum(aligned, 0) - aligned
    count_start = torch.cumsum(counts.to(torch.int64), 0) - counts.to(torch.int64)
    position = torch.arange(num_entries, device=recv_topk_idx.device)
    slots = torch.full((num_rows * topk,), -1, dtype=torch.int32, device=recv_topk_idx.device)
    slots[chosen] = (aligned_start[expert_of] + position - count_start[expert_of]).to(torch.int32)
    return slots.view(num_rows, topk)


def scatter_rows(rows: torch.Tensor, slots: torch.Tensor, num_expanded: int) -> torch.Tensor:
    """Each row copied to its entries' expanded rows; rows no entry points at are zero.

    Arguments:
        rows: `[num_rows, ...]`.
        slots: `[num_rows, num_topk]`, expanded_slots' result.
        num_expanded: the expanded rows.

    Returns:
        expanded: `[num_expanded, ...]` of rows' dtype.
    """
    out = torch.zeros((num_expanded,) + tuple(rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    mask = slots >= 0
    source = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1).expand_as(slots)[mask]
    out[slots[mask].to(torch.int64)] = rows[source]
    return out


def tma_column_major(scales: torch.Tensor) -> torch.Tensor:
    """Scales `[num_rows, groups]` in DeepEP 2's TMA-aligned column-major layout: the same values, strides (1,
    align(num_rows, 4))."""
    num_rows, groups = scales.shape
    storage = torch.zeros(groups, align(max(num_rows, 1), 4), dtype=scales.dtype, device=scales.device)
    out = storage.t()[:num_rows]
    out.copy_(scales)
    return out


class SlotContributions:
    """What each received row sends back for each top-k slot of its token, so that every slot of a token comes from
    exactly one rank (the owner of that slot's expert) and the source adds them in slot order, as DeepEP 2's
    reference combine does. One slot at a time (a combine each), so that no [num_topk, rows, hidden] tensor is made.

    Non-expanded (`slots` None): x holds each row's local sum; it goes at the row's last local slot. Expanded with
    `reduce_local`: the row's local entries are added in slot order (float, then bf16) and go at its last local slot;
    without: each local entry goes at its own slot.
    """

    def __init__(self, x: torch.Tensor, recv_topk_idx: torch.Tensor, slots: Optional[torch.Tensor],
                 reduce_local: bool) -> None:
        """
        Arguments:
            x: `[num_rows, hidden]` (non-expanded) or `[num_expanded, hidden]` (expanded) with `torch.bfloat16`.
            recv_topk_idx: `[num_rows, num_topk]`, local expert indices, -1 for none.
            slots: expanded_slots' result, or None for the non-expanded layout.
            reduce_local: add a row's local entries before sending (DeepEP 2's allow_multiple_reduction).
        """
        self.num_rows, self.topk = recv_topk_idx.shape
        self.x, self.slots = x, slots
        positions = torch.arange(self.topk, device=x.device).expand(self.num_rows, self.topk)
        self.last = torch.where(recv_topk_idx >= 0, positions, torch.full_like(positions, -1)).max(1).values
        self.row_values = None
        if slots is None:
            self.row_values = x[:self.num_rows]
        elif reduce_local:
            total = torch.zeros(self.num_rows, x.shape[1], dtype=torch.float32, device=x.device)
            for j in range(self.topk):
                here = slots[:, j] >= 0
                total[here] += x[slots[here, j].to(torch.int64)].float()
            self.row_values = total.to(torch.bfloat16)

    def slot(self, j: int) -> torch.Tensor:
        """`[num_rows, hidden]` with `torch.bfloat16`: what each row sends for slot j (zero where not its)."""
        out = torch.zeros(self.num_rows, self.x.shape[1], dtype=torch.bfloat16, device=self.x.device)
        if self.row_values is not None:
            here = self.last == j
            out[here] = self.row_values[here]
        else:
            here = self.slots[:, j] >= 0
            out[here] = self.x[self.slots[here, j].to(torch.int64)]
        return out


def reduce_slots(parts: List[torch.Tensor], topk_idx: torch.Tensor, experts_per_group: Optional[int],
                 bias: Optional[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]) -> torch.Tensor:
    """The source side of the combine: slots of the same scale-up domain added first when asked (hybrid), then every
    slot in order onto the bias, in float, then bf16 (DeepEP 2's reference combine).

    Arguments:
        parts: num_topk `[num_tokens, hidden]` with `torch.bfloat16`, each slot's value.
        topk_idx: `[num_tokens, num_topk]`, the dispatch's expert indices.
        experts_per_group: experts per scale-up domain to add within first, or None.
        bias: (bias_0, bias_1), either None.

    Returns:
        combined_x: `[num_tokens, hidden]` with `torch.bfloat16`.
    """
    stacked = torch.stack(parts, 1)  # [tokens, topk, hidden]
    if experts_per_group is not None:
        stacked = _grouped_reduce(stacked, torch.div(topk_idx, experts_per_group, rounding_mode="floor"))
    result = torch.zeros(stacked.shape[0], stacked.shape[2], dtype=torch.float32, device=stacked.device)
    bias_0, bias_1 = bias if bias is not None else (None, None)
    if bias_0 is not None and bias_1 is not None:
        result = bias_0.float() + bias_1.float()
    elif bias_0 is not None or bias_1 is not None:
        result = (bias_0 if bias_0 is not None else bias_1).float().clone()
    for j in range(stacked.shape[1]):
        result += stacked[:, j].float()
    return result.to(torch.bfloat16)


def _grouped_reduce(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Within each token, the slots of one group added in slot order (float, then bf16) at the group's last slot;
    its other slots zero."""
    num_tokens, topk, hidden = values.shape
    out = torch.zeros_like(values)
    for g in torch.unique(group).tolist():
        member = group == g
        positions = torch.arange(topk, device=values.device).expand(num_tokens, topk)
        last = torch.where(member, positions, torch.full_like(positions, -1)).max(1).values
        total = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=values.device)
        for j in range(topk):
            zero = torch.zeros((), dtype=torch.float32, device=values.device)
            total += torch.where(member[:, j:j + 1], values[:, j].float(), zero)
        has = last >= 0
        rows = torch.arange(num_tokens, device=values.device)
        out[rows[has], last[has]] = total.to(values.dtype)[has]
    return out
