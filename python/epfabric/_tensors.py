"""torch tensors <-> the C ABI's tensor descriptors, and the allocator through which the library's outputs are torch
tensors allocated by torch on the caller's device and stream (no copies)."""
import ctypes
import math
import struct

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

# A descriptor (epf_tensor) as raw bytes: the hot paths write and read them in place in the ctypes argument and result
# structs, one struct call per tensor instead of a ctypes object and a field assignment each.
_DESC = struct.Struct("@Pii4q")
_PACK = _DESC.pack_into
_HEAD = struct.Struct("@Pii")
assert _DESC.size == ctypes.sizeof(_lib.Tensor)
_PAD = ((0, 0, 0, 0), (0, 0, 0), (0, 0), (0,), ())
_ELEMENT_SIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _FROM_EPF.values()}


def _name(dtypes):
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def device_index(device):
    """What Tensor.get_device() returns for tensors on `device` (-1 for the CPU)."""
    return device.index if device.type == "cuda" else -1


def _refuse(t, name, dtypes, ndim, device):
    """Raises the TypeError/ValueError that describes what is wrong with `t`."""
    if t is None:
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
    raise AssertionError(f"{name}: no reason to refuse it")


def put(dst, offset, t, name, dtypes, ndim, device, index, optional=False):
    """Checks `t` (dtype, rank, device `device` whose get_device() is `index`, contiguity) and writes its descriptor
    at byte `offset` of the ctypes struct `dst` (an optional None: "not given"). Raises TypeError/ValueError naming
    `name`: nothing reaches the library, nothing is launched."""
    try:
        dtype = t.dtype
        if dtype in dtypes and t.dim() == ndim and t.get_device() == index and t.is_contiguous():
            _PACK(dst, offset, t.data_ptr() if t.numel() else 0, _TO_EPF[dtype], ndim, *t.shape, *_PAD[ndim])
            return
    except AttributeError:  # not a tensor (None included)
        pass
    if t is None and optional:
        _PACK(dst, offset, 0, 0, 0, 0, 0, 0, 0)
        return
    _refuse(t, name, dtypes, ndim, device)


def describe(t, name, dtypes, ndim, device, optional=False):
    """Checks `t` as put() does and returns its descriptor (a new epf_tensor)."""
    d = _lib.Tensor()
    put(d, 0, t, name, dtypes, ndim, device, device_index(device), optional)
    return d


def shape_of(d):
    return [d.shape[i] for i in range(d.ndim)]


class Allocator:
    """The library's allocator callbacks (epf_allocator): every output is one torch tensor of its dtype and shape on
    `device` (on the current stream, which is the stream the library launches on), made by alloc_tensor; blocks of
    bytes (alloc) only where the library asks for them. Tensors the library still needs (handles, pending hooks) stay
    in `live`; those it let go of during a call stay in `released` until the call's outputs were wrapped."""

    def __init__(self, device):
        self.device = device
        self.live = {}
        self.released = {}
        self.alloc_fn = _lib.ALLOC_FN(self._alloc)
        self.free_fn = _lib.FREE_FN(self._free)
        self.alloc_tensor_fn = _lib.ALLOC_TENSOR_FN(self._alloc_tensor)
        self.callbacks = _lib.AllocatorCallbacks(ctypes.sizeof(_lib.AllocatorCallbacks), self.alloc_fn, self.free_fn,
                                                 None, self.alloc_tensor_fn)

    def _alloc(self, _ctx, nbytes, _stream):
        block = torch.empty(max(16, (nbytes + 15) // 16 * 16), dtype=torch.uint8, device=self.device)
        ptr = block.data_ptr()
        self.live[ptr] = block
        return ptr

    def _alloc_tensor(self, _ctx, dtype, ndim, shape, nbytes, _stream):
        if nbytes:
            t = torch.empty(shape[:ndim], dtype=_FROM_EPF[dtype], device=self.device)
        else:  # no elements: the library still wants a non-null pointer (it never reads or writes through it)
            t = torch.empty(16, dtype=torch.uint8, device=self.device)
        ptr = t.data_ptr()
        self.live[ptr] = t
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
                if base <= ptr < base + block.numel() * block.element_size():
                    return block, ptr - base
        return None, 0

    def wrap_at(self, src, offset):
        """The torch tensor behind the output descriptor at byte `offset` of ctypes struct `src` (None when the
        output was not produced): the very tensor alloc_tensor made for it."""
        ptr, dtype, ndim = _HEAD.unpack_from(src, offset)
        if not ptr and not ndim:  # not produced
            return None
        if ptr:
            t = self.live.get(ptr)
            if t is None:
                t = self.released.get(ptr)
            if t is not None and t.dtype is _FROM_EPF[dtype] and t.dim() == ndim:
                return t
        return self.wrap(_lib.Tensor.from_buffer(src, offset))

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
        if block.dtype is dtype and offset == 0 and list(block.shape) == shape:
            return block
        nbytes = numel * _ELEMENT_SIZE[dtype]
        return block.view(torch.uint8).view(-1)[offset:offset + nbytes].view(dtype).view(shape)


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
