"""The argument and result structs of a Buffer's calls, the byte offsets the hot paths write and read in place
(_tensors.put, wrap_at), and the dtypes each descriptor accepts."""
import ctypes

import torch

from . import _lib, _tensors
from ._lib import lib

_I64, _I32, _F32, _BF16, _BOOL = (torch.int64,), (torch.int32,), (torch.float32,), (torch.bfloat16,), (torch.bool,)
_SCALES = (torch.float32, torch.int32)
_FP8_DATA = tuple(d for d in (_tensors.FP8, torch.uint8) if d is not None)
_MAX_LOCAL_EXPERTS = 1024  # per-expert counts a dispatch returns at most


def _offsets(cls, *names):
    """Byte offsets of descriptor fields: the hot paths write and read them in place (_tensors.put, wrap_at)."""
    return tuple(getattr(cls, name).offset for name in names)


_DA_X, _DA_SCALES, _DA_IDX, _DA_W = _offsets(_lib.DispatchArgs, "x", "x_scales", "topk_idx", "topk_weights")
_LAYOUT_OFFSETS = _offsets(_lib.Layout, "num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank",
                           "num_invalid_topk")
_LA_PER_RANK, _LA_PER_EXPERT, _LA_IN_RANK, _LA_INVALID = _LAYOUT_OFFSETS
_DISPATCH_OUTPUTS = _offsets(_lib.DispatchResult, "recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights")
_CA_X, _CA_W, _CA_BIAS_0, _CA_BIAS_1 = _offsets(_lib.CombineArgs, "x", "topk_weights", "bias_0", "bias_1")
_CR_X, _CR_W = _offsets(_lib.CombineResult, "combined_x", "combined_topk_weights")
# The C functions of the hot paths, called directly (their status checked by the caller).
_GET_LAYOUT, _DISPATCH, _COMBINE = lib.epf_get_dispatch_layout, lib.epf_dispatch_ex, lib.epf_combine


class _Calls:
    """The argument and result structs of one Buffer's calls, made once and refilled by every call (a Buffer's calls
    are not concurrent: its kernels share one region), with their byref()s."""

    def __init__(self):
        self.dispatch_args = _lib.DispatchArgs()
        self.layout = _lib.Layout()
        self.layout_pointer = ctypes.pointer(self.layout)
        self.dispatch_options = _lib.DispatchOptions(ctypes.sizeof(_lib.DispatchOptions), 0)
        self.counts = (ctypes.c_int32 * _MAX_LOCAL_EXPERTS)()
        self.dispatch_result = _lib.DispatchResult()
        self.dispatch_result.num_recv_tokens_per_expert = self.counts
        self.dispatch_result.num_local_experts_capacity = _MAX_LOCAL_EXPERTS
        self.combine_args = _lib.CombineArgs()
        self.combine_result = _lib.CombineResult()
        self.ll_dispatch_args = _lib.LLDispatchArgs()
        self.ll_dispatch_result = _lib.LLDispatchResult()
        self.ll_combine_args = _lib.LLCombineArgs()
        self.ll_combine_result = _lib.LLCombineResult()
        self.ll_options = _lib.LLOptions(ctypes.sizeof(_lib.LLOptions))
        for name in ("dispatch_args", "dispatch_options", "dispatch_result", "combine_args", "combine_result",
                     "ll_dispatch_args", "ll_dispatch_result", "ll_combine_args", "ll_combine_result", "ll_options"):
            setattr(self, name + "_ref", ctypes.byref(getattr(self, name)))
