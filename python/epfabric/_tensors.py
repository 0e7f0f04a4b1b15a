"""torch tensors <-> the C ABI's tensor descriptors, and the allocator through which the library's outputs are torch
tensors allocated by torch on the caller's device and stream (no copies)."""
import ctypes
import math

import torch

from . import _lib

FP8 = getattr(torch, "float8_e4m3fn", None)  # torch >= 2.1; older torch carries FP8 e4m3 bytes as uint8

_TO_EPF = {torch.bfloat16: _lib.BF16, torch.float32: _lib.FLOAT32, torch.int32: _lib.INT32, torch.int64: _lib.INT64,
           torch.bool: _lib.BOOL, torch.uint8: _lib.FP8_E4M3}
if FP8 is not None:
    _TO_EPF[FP8] = _lib.FP8_E4M3
_FROM_EPF = {_lib.BF16: torch.bfloat16, _lib.FP8_E4M3: FP8 if FP8 is not None else torch.uint8,
             _lib.FLOAT32: torch.float32, _lib.INT32: torch.int32, _lib.INT64: torch.int64, _lib.BOOL: torch.bool}

NOT_GIVEN = _lib.Tensor()


def _name(dtypes):
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def describe(t, name, dtypes, ndim, device, optional=False):
    """Checks `t` (dtype, rank, device, contiguity) and returns its descriptor. Raises TypeError/ValueError naming
    `name`: nothing reaches the library, nothing is launched."""
    if t is None:
        if optional:
            return _lib.Tensor()
        raise ValueError(f"{name} is required")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}.dtype = {t.dtype}: expected {_name(dtypes)}")
    if t.dim() != ndim:
        raise ValueError(f"{name} has {t.dim()} dimensions {tuple(t.shape)}: expected {ndim}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}: this buffer's tensors live on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (strides {t.stride()} for shape {tuple(t.shape)}): "
                         f"pass {name}.contiguous()")
    d = _lib.Tensor()
    d.data = t.data_ptr() if t.numel() > 0 else None
    d.dtype = _TO_EPF[t.dtype]
    d.ndim = t.dim()
    for i, n in enumerate(t.shape):
        d.shape[i] = n
    return d


def shape_of(d):
    return [d.shape[i] for i in range(d.ndim)]


class Allocator:
    """The library's epf_alloc_fn/epf_free_fn: every block is a torch uint8 tensor on `device` (on the current
    stream, which is the stream the library launches on). Blocks the library still needs (handles, pending hooks)
    stay in `live`; blocks it let go of during a call stay in `released` until the call's outputs were wrapped."""

    def __init__(self, device):
        self.device = device
        self.live = {}
        self.released = {}
        self.alloc_fn = _lib.ALLOC_FN(self._alloc)
        self.free_fn = _lib.FREE_FN(self._free)

    def _alloc(self, _ctx, nbytes, _stream):
        block = torch.empty(max(16, (nbytes + 15) // 16 * 16), dtype=torch.uint8, device=self.device)
        ptr = block.data_ptr()
        self.live[ptr] = block
        return ptr

    def _free(self, _ctx, ptr, _stream):
        block = self.live.pop(ptr, None)
        if block is not None:
            self.released[ptr] = block

    def end_call(self):
        self.released.clear()

    def _block(self, ptr):
        block = self.live.get(ptr)
        if block is None:
            block = self.released.get(ptr)
        if block is not None:
            return block, 0
        for table in (self.live, self.released):  # a view into a larger block
            for base, block in table.items():
                if base <= ptr < base + block.numel():
                    return block, ptr - base
        return None, 0

    def wrap(self, d):
        """The torch tensor behind an output descriptor (None when the output was not produced)."""
        if d.ndim == 0 and not d.data:
            return None
        shape = shape_of(d)
        dtype = _FROM_EPF[d.dtype]
        numel = math.prod(shape)
        if numel == 0 or not d.data:
            return torch.empty(shape, dtype=dtype, device=self.device)
        block, offset = self._block(d.data)
        if block is None:
            raise RuntimeError(f"epfabric returned memory it did not allocate through torch ({d.data:#x})")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return block[offset:offset + nbytes].view(dtype).view(shape)


class _CudaArray:
    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def from_pointer(ptr, nbytes, device):
    """A uint8 tensor over memory this process has mapped (a region): no copy; its owner must outlive it."""
    if device.type == "cuda":
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def view_as(raw, d):
    """`raw` (uint8) viewed with descriptor `d`'s dtype and shape."""
    shape = shape_of(d)
    dtype = _FROM_EPF[d.dtype]
    numel = math.prod(shape)
    return raw.view(dtype)[:numel].view(shape)
