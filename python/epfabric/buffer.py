"""epfabric.Buffer: DeepEP's Buffer API (names, parameters, return values) over a lease of a daemon-owned group.

    buf = epfabric.Buffer.attach("/run/epfabric/d0.sock", group="moe", rank=0, token=token)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buf.get_dispatch_layout(topk_idx, 256)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, _, _ = buf.combine(expert_out, handle, topk_weights=recv_topk_weights)

Kernels run on the caller's current CUDA stream (cuda groups) or on the calling thread (host-backend groups, CPU
tensors); outputs are torch tensors allocated by torch. docs/python.md lists where behaviour differs from DeepEP.
"""
import ctypes
import operator
from typing import Dict, Optional, Tuple

import torch

from . import _lib, _tensors
from ._lib import call, lib
from ._tensors import put
from .client import Client
from .low_latency import LowLatencyMixin
from .utils import Config, EventOverlap

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
_NO_EVENT = EventOverlap()  # what calls without async_finish return: it holds nothing, so one serves every call
# The calling thread's current stream on a device as a raw handle: torch's own accessor (0.1 us on an H100 against
# 3.3 us for torch.cuda.current_stream(device).cuda_stream, bench/python_call_breakdown.py); absent in CPU-only builds.
_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


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
_PREFIX_REASON = ("it needs every rank's num_tokens_per_rank, which the C library does not export; "
                  "epfabric.deep_ep.Buffer computes it with EPFABRIC_RANK_PREFIX_MATRIX=gather")
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
    (`[i][j]` = tokens ranks 0..i send to rank j) where the Buffer can compute it; every other field is an
    UnavailableField (docs/python.md).

    Attributes:
        num_recv_tokens, num_tokens, hidden, topk: the dispatch's received rows, rows, hidden size and top-k.
    """

    def __new__(cls, c_handle: ctypes.c_void_p, num_recv_tokens: int, num_tokens: int, hidden: int, topk: int,
                is_token_in_rank: Optional[torch.Tensor] = None, rank_prefix_matrix: Optional[torch.Tensor] = None,
                internode: bool = False, serial: int = 0):
        known = {"is_token_in_rank": is_token_in_rank, "rank_prefix_matrix": rank_prefix_matrix}
        fields = []
        for name in (_INTERNODE_FIELDS if internode else _INTRANODE_FIELDS):
            value = known.get(name)
            if value is None:
                value = UnavailableField(name, _PREFIX_REASON if name == "rank_prefix_matrix" else _NOT_EXPOSED)
            fields.append(value)
        self = super().__new__(cls, fields)
        self._c = c_handle
        self._serial = serial  # which C Buffer of its Buffer made it (Buffer._normal_serial)
        self.num_recv_tokens, self.num_tokens, self.hidden, self.topk = num_recv_tokens, num_tokens, hidden, topk
        return self

    def __del__(self):
        if lib is not None and getattr(self, "_c", None):
            lib.epf_dispatch_handle_destroy(self._c)
            self._c = None


class Hook:
    """A receive hook (return_recv_hook=True): call it once, on the stream that should run the receive phase."""

    def __init__(self, buffer, c_hook):
        self._buffer = buffer
        self._c = ctypes.c_void_p(c_hook)

    def __call__(self):
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


def _issue_code(low_latency_issue):
    """epf_buffer_options.low_latency_issue for Buffer's low_latency_issue argument."""
    if low_latency_issue not in _lib.LOW_LATENCY_ISSUE:
        raise ValueError(f"low_latency_issue={low_latency_issue!r}: "
                         f"expected one of {', '.join(_lib.LOW_LATENCY_ISSUE)}")
    return _lib.LOW_LATENCY_ISSUE[low_latency_issue]


class Buffer(LowLatencyMixin):
    num_sms = 20  # DeepEP's class-wide SM count (set_num_sms)

    def __init__(self, client, lease, *, timeout_s=5.0, num_sms=None, low_latency_sms=0, low_latency_issue="auto",
                 enable_shrink=False):
        """Use Buffer.attach (or epfabric.deep_ep.Buffer): this takes an attached lease. With enable_shrink, low
        latency masks a lost or silent rank and goes on without it (DeepEP's enable_shrink); without it such a call
        raises, naming the rank."""
        self._low_latency_issue = _issue_code(low_latency_issue)
        self._enable_shrink = bool(enable_shrink)
        self._client = client
        self._lease = lease
        # One C Buffer per mode, made by the first call of that mode (its shapes set it up): normal mode's, and
        # low latency's. A low-latency group that also serves normal mode (num_normal_bytes) has both.
        self._cbuf = None
        self._cfg = None
        self._ll_cbuf = None
        self._ll_cfg = None
        self._timeout_s = float(timeout_s)
        self._num_sms = num_sms
        self._low_latency_sms = int(low_latency_sms)
        self._last_layout = None
        self.rank = lib.epf_lease_rank(lease)
        self.group_size = lib.epf_lease_world_size(lease)
        self.num_nvl_ranks = lib.epf_lease_num_nvl_ranks(lease)
        self.low_latency_mode = bool(lib.epf_lease_low_latency(lease))
        # Bytes of each NVL / RDMA region for normal mode in a low-latency group that serves both modes (else 0).
        self.num_normal_bytes = lib.epf_lease_num_normal_bytes(lease)
        self.num_normal_rdma_bytes = lib.epf_lease_num_normal_rdma_bytes(lease)
        self.normal_mode = not self.low_latency_mode or self.num_normal_bytes > 0
        self.backend = lib.epf_lease_backend(lease)
        if self.backend == _lib.BACKEND_CUDA:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._dev_index = _tensors.device_index(self.device)
        self._alloc = _tensors.Allocator(self.device)
        self._calls = _Calls()
        self._normal_key = None  # the last (hidden, topk, num_experts, num_sms) that _ensure_normal accepted
        self._ll_key = None  # the last low-latency (max_tokens, hidden, topk, num_experts) that was accepted
        self._normal_serial = 0  # C Buffers made for normal mode so far (a handle records the one that made it)
        self._ll_serial = 0  # the same for low latency
        self.num_nvl_bytes = self._region_bytes(False)
        self.num_rdma_bytes = self._region_bytes(True)

    @classmethod
    def attach(cls, socket, group, rank, token, *, timeout_s=5.0, num_sms=None, low_latency_sms=0,
               low_latency_issue="auto", client_name="epfabric-python", enable_shrink=False):
        """Attaches group rank `rank` of `group` through the daemon at `socket` (the daemon that serves that rank).
        On cuda groups the current CUDA device is the one whose kernels use the regions. num_sms: normal mode's SMs
        (default Buffer.num_sms); low_latency_sms: low-latency blocks per launch (0: every SM; ranks sharing a GPU
        in one process each need a share). low_latency_issue: who puts low latency's bytes for ranks on other hosts
        on cuda: "device" (kernels; capturable into CUDA graphs), "relay" (the calling thread between launches), or
        "auto" (device on the verbs wire, relay on the socket wire, unless EPF_LOW_LATENCY_ISSUE says)."""
        _issue_code(low_latency_issue)  # refused before anything is attached
        client = Client(socket, client_name=client_name)
        lease = ctypes.c_void_p()
        call("epf_attach", client.handle, group.encode(), int(rank), token.encode(), -1, ctypes.byref(lease))
        return cls(client, lease, timeout_s=timeout_s, num_sms=num_sms, low_latency_sms=low_latency_sms,
                   low_latency_issue=low_latency_issue, enable_shrink=enable_shrink)

    # ---- DeepEP's static calls ----

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP: whether its kernels were built for SM90, which its FP8 paths need (callers gate FP8 inputs on it).
        epfabric's kernels have the FP8 paths (e4m3 data with float or packed UE8M0 scales) on every backend it runs
        on, the host backend included, so it is always True and callers exercise them.

        Returns:
            True.
        """
        return True

    @staticmethod
    def set_num_sms(new_num_sms):
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture():
        return EventOverlap(_record_event())

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """Bytes of region a low-latency group of `num_ranks` ranks on one host needs (CreateGroup's num_nvl_bytes;
        epfabric.deep_ep passes it as DeepEP's num_rdma_bytes). The shape is remembered, so that a drop-in Buffer
        given this size for a group across hosts can size its RDMA region exactly (low_latency_shape_of)."""
        hint = required_group_bytes(num_max_dispatch_tokens_per_rank, hidden, 9, num_experts, True, 1, num_ranks)[0]
        _HINTED_SHAPES[hint] = (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        return hint

    # ---- lifetime ----

    def destroy(self):
        """Releases the Buffer and the lease (the daemon zeroes this rank's region for the next client)."""
        self._release()

    def _release(self):
        # Local only (no collective step): also what garbage collection runs, where a barrier could hang.
        for name in ("_cbuf", "_ll_cbuf"):
            if getattr(self, name) is not None:
                lib.epf_buffer_destroy(getattr(self, name))
                setattr(self, name, None)
        self._release_layout()
        if self._lease is not None:
            try:
                call("epf_lease_detach", self._lease)
            finally:
                lib.epf_lease_destroy(self._lease)
                self._lease = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def __del__(self):
        if lib is not None and getattr(self, "_lease", None) is not None:
            try:
                self._release()
            except Exception:  # a daemon that is gone: the lease ends with the connection anyway
                pass

    def get_comm_stream(self):
        """epfabric launches on the caller's stream: this is the current stream (None on the host backend)."""
        return torch.cuda.current_stream() if self.device.type == "cuda" else None

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """This rank's region (or RDMA region) as a tensor of `dtype`, from byte `offset`, shaped `size`."""
        data, nbytes = ctypes.c_void_p(), ctypes.c_uint64()
        call("epf_lease_region", self._live_lease(), int(bool(use_rdma_buffer)), ctypes.byref(data),
             ctypes.byref(nbytes))
        if offset < 0 or offset > nbytes.value:
            raise ValueError(f"offset = {offset}: the region has {nbytes.value} bytes")
        raw = _tensors.from_pointer(data.value + offset, nbytes.value - offset, self.device)
        element = torch.empty((), dtype=dtype).element_size()
        t = raw[:(raw.numel() // element) * element].view(dtype)
        if size is None:
            return t
        size = torch.Size(size)
        if size.numel() > t.numel():
            raise ValueError(f"size {tuple(size)} needs {size.numel() * element} bytes; the region has "
                             f"{t.numel() * element} from offset {offset}")
        return t[:size.numel()].view(size)

    # ---- normal mode ----

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """Returns (num_tokens_per_rank, num_tokens_per_rdma_rank (None), num_tokens_per_expert, is_token_in_rank,
        event)."""
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
            return per_rank, None, per_expert, in_rank, self._event(async_finish)
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
        return per_rank, None, per_expert, in_rank, self._event(async_finish)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event);
        recv_x is (data, scales) when x is (fp8 data, scales), the received scales of the input's dtype (float32, or
        int32 packed UE8M0). With num_worst_tokens > 0 nothing waits on the host
        (CUDA-graph capturable): every output has num_worst_tokens rows, rows past the received ones have top-k index
        -1 and weight 0, and num_recv_tokens_per_expert_list is [] (as DeepEP)."""
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
            new_handle = DispatchHandle(ctypes.c_void_p(result.handle), result.num_recv_tokens, num_tokens, hidden,
                                        topk, is_token_in_rank, self._rank_prefix_matrix(num_tokens_per_rank),
                                        self.group_size != self.num_nvl_ranks, self._normal_serial)
            per_expert = calls.counts[:min(result.num_local_experts, _MAX_LOCAL_EXPERTS)]
        else:  # the cached handle stays the handle
            lib.epf_dispatch_handle_destroy(ctypes.c_void_p(result.handle))
            new_handle, per_expert = handle, []
        out_x = (recv_x, recv_scales) if fp8 else recv_x
        return out_x, recv_topk_idx, recv_topk_weights, per_expert, new_handle, self._event(async_finish)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        """Returns (combined_x, combined_topk_weights, event)."""
        self._normal_only("combine")
        if not isinstance(handle, DispatchHandle):
            raise TypeError("handle must be the DispatchHandle that dispatch returned")
        self._check_handle(handle, "combine")
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

    # ---- errors and recovery ----

    def check(self):
        """cuda: waits for the current stream and reports a kernel's timeout (DEADLINE_EXCEEDED naming the rank)."""
        for cbuf in (self._cbuf, self._ll_cbuf):
            if cbuf is not None:
                call("epf_buffer_check", cbuf, self._stream())

    def reset(self):
        """After a timeout: every rank calls reset() (nothing of the group in flight) before the next operation."""
        for cbuf in (self._cbuf, self._ll_cbuf):
            if cbuf is not None:
                call("epf_buffer_reset", cbuf, self._stream())

    # ---- internals ----

    def _live_lease(self):
        if self._lease is None:
            raise RuntimeError("this Buffer was destroyed")
        return self._lease

    def _region_bytes(self, rdma):
        data, nbytes = ctypes.c_void_p(), ctypes.c_uint64()
        return nbytes.value if lib.epf_lease_region(self._lease, int(rdma), ctypes.byref(data),
                                                    ctypes.byref(nbytes)) == 0 else 0

    def _stream(self):
        if self._dev_index >= 0:
            if _CURRENT_RAW_STREAM is not None:
                return _CURRENT_RAW_STREAM(self._dev_index)
            return torch.cuda.current_stream(self.device).cuda_stream
        return None

    def _wait(self, previous_event):
        if previous_event is not None:
            previous_event.current_stream_wait()

    def _event(self, async_finish):
        return EventOverlap(_record_event()) if async_finish and self._dev_index >= 0 else _NO_EVENT

    def _release_layout(self):
        if self._last_layout is not None:
            lib.epf_layout_release(ctypes.byref(self._last_layout[0]))
            self._last_layout = None

    def _normal_only(self, what):
        if not self.normal_mode:
            raise RuntimeError(f"{what}: this group was created in low-latency mode without a normal-mode part; "
                               "normal dispatch/combine need a group created without low_latency, or with "
                               "num_normal_bytes (docs/python.md)")

    def _new_cbuf(self, config):
        cbuf = ctypes.c_void_p()
        options = _lib.BufferOptions(ctypes.sizeof(_lib.BufferOptions), self._low_latency_issue,
                                     int(self._enable_shrink))
        call("epf_buffer_create_opts", self._live_lease(), ctypes.byref(config), ctypes.byref(self._alloc.callbacks),
             ctypes.byref(options), ctypes.byref(cbuf))
        return cbuf

    def _rank_prefix_matrix(self, num_tokens_per_rank: torch.Tensor) -> Optional[torch.Tensor]:
        """DeepEP's rank_prefix_matrix for a dispatch's handle, or None where it cannot be computed: it needs every
        rank's num_tokens_per_rank, which the C library does not export (epfabric.deep_ep.Buffer can gather them).

        Arguments:
            num_tokens_per_rank: `[num_ranks]` with `torch.int`, this rank's tokens to each rank.

        Returns:
            rank_prefix_matrix: `[num_ranks, num_ranks]` with `torch.int`, or None.
        """
        return None

    def _sync_ranks(self) -> bool:
        """Waits until every rank of the group has reached this point with nothing of the group in flight (the
        replacement of a C Buffer, see _renew). epfabric.Buffer has no channel between its ranks but the library's
        kernels, so it cannot: False. epfabric.deep_ep.Buffer waits on its process group.

        Returns:
            whether the ranks were synchronized.
        """
        return False

    def _renew(self, name: str, config: "_lib.BufferConfig", shape: Dict[str, int]) -> None:
        """Makes the C Buffer of attribute `name` (`_cbuf` or `_ll_cbuf`) for `config`, replacing the one there.

        Every rank replaces its C Buffer at the same call (they see the same sequence of shapes, as in DeepEP's usage),
        so: the ranks synchronize (nothing of the group in flight), each destroys its old C Buffer, makes the new one
        and resets it (the new layout's signals in its own region are zeroed), and the ranks synchronize again before
        anyone writes into a peer's region. The first C Buffer of a mode needs none of it (the daemon zeroed the
        region when the lease started).

        Arguments:
            name: `_cbuf` (normal mode) or `_ll_cbuf` (low latency).
            config: the new C Buffer's configuration.
            shape: its shape, for the messages (hidden, topk, num_experts, ...).
        """
        old = getattr(self, name)
        if old is not None:
            cfg = self._cfg if name == "_cbuf" else self._ll_cfg
            if not self._sync_ranks():
                changed = ", ".join(f"{k} = {v}" for k, v in shape.items() if k != "max_tokens" and cfg.get(k) != v)
                raise ValueError(f"{changed or shape}: this Buffer's C Buffer was set up for {cfg}; epfabric.Buffer "
                                 "cannot replace it (its ranks share no barrier): every rank must create a new Buffer "
                                 "for another shape (epfabric.deep_ep.Buffer replaces it on every rank)")
            if name == "_cbuf":
                self._release_layout()  # the old C Buffer's layout: a dispatch then checks its top-k itself
            lib.epf_buffer_destroy(old)
            setattr(self, name, None)
        cbuf = self._new_cbuf(config)
        setattr(self, name, cbuf)
        if old is not None:
            call("epf_buffer_reset", cbuf, self._stream())
            self._sync_ranks()

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
        """Makes sure the normal-mode C Buffer serves a dispatch of this shape: the one there when it does (hidden and
        top-k up to its own, the same experts and SMs, tokens up to what it holds), else a new one (_renew) for a shape
        that covers both (the larger hidden size and top-k) when the group's regions hold it with `num_tokens` tokens
        per rank, else for this call's shape alone.

        Arguments:
            hidden: the call's hidden size.
            topk: the call's top-k (1 without top-k).
            num_experts: the call's number of experts.
            num_tokens: the call's tokens.
            config: the call's Config (its num_sms), or None for the Buffer's.

        Raises:
            ValueError: the group's regions hold no C Buffer for this call, saying the bytes it needs and the bytes the
                group has.
        """
        num_sms = config.num_sms if config is not None else (self._num_sms or Buffer.num_sms)
        key = (hidden, topk, num_experts, num_sms)
        cfg = self._cfg
        if cfg is not None:
            if key == self._normal_key and num_tokens <= cfg["max_tokens"]:  # as the last call: checked then
                return
            if (hidden <= cfg["hidden"] and topk <= cfg["topk"] and num_experts == cfg["num_experts"]
                    and num_sms == cfg["num_sms"] and num_tokens <= cfg["max_tokens"]):
                self._normal_key = key
                return
        candidates = [(hidden, max(topk, 1))]
        if cfg is not None:
            candidates.insert(0, (max(hidden, cfg["hidden"]), max(topk, cfg["topk"])))
        for cover_hidden, cover_topk in candidates:
            c = self._normal_fit(cover_hidden, cover_topk, num_experts, num_sms, num_tokens)
            if c is not None:
                break
        else:
            hosts = self.group_size // self.num_nvl_ranks
            need = required_group_bytes(max(num_tokens, 1), hidden, max(topk, 1), num_experts, False, hosts,
                                        self.num_nvl_ranks, num_sms)
            have = self._normal_region_bytes()
            raise ValueError(f"a dispatch of {num_tokens} tokens of hidden {hidden}, top-{topk}, {num_experts} "
                             f"experts, {num_sms} SMs needs {need[0]} NVL and {need[1]} RDMA bytes per rank; the "
                             f"group has {have[0]} NVL and {have[1]} RDMA bytes for normal mode")
        shape = {"hidden": c.hidden, "topk": c.max_topk, "num_experts": num_experts, "num_sms": num_sms,
                 "max_tokens": c.max_tokens_per_rank}
        self._normal_key = None
        self._renew("_cbuf", c, shape)
        self._cfg = shape
        self._normal_serial += 1
        self._normal_key = key

    def _check_handle(self, handle: "DispatchHandle", what: str) -> None:
        """A handle from a C Buffer that has since been replaced (another shape) is refused."""
        if handle._serial != self._normal_serial:
            raise ValueError(f"{what}: this handle came from a dispatch before the Buffer was set up again for "
                             f"another shape ({self._cfg}); dispatch again and use the new handle")


def _count(name, value):
    """An int >= 0 (a Python or numpy int): ValueError/TypeError naming `name` otherwise."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} = {value}: must be >= 0")
    return value


def _config(max_tokens, hidden, topk, num_experts, num_sms, low_latency, timeout_s):
    c = _lib.BufferConfig()
    c.max_tokens_per_rank, c.hidden, c.max_topk, c.num_experts = max_tokens, hidden, topk, num_experts
    c.num_sms, c.low_latency, c.timeout_s = num_sms, int(low_latency), timeout_s
    return c


# get_low_latency_rdma_size_hint's results in this process: bytes -> (max tokens per rank, hidden, ranks, experts).
_HINTED_SHAPES = {}


def low_latency_shape_of(hint_bytes, num_ranks=None):
    """The (max tokens per rank, hidden, ranks, experts) that get_low_latency_rdma_size_hint returned `hint_bytes`
    for in this process, or None. With `num_ranks`, a size that is not a hint itself (DeepEP's callers pass the larger
    of the normal-mode and the low-latency sizes) gives the largest hinted shape of that many ranks that fits in it."""
    shape = _HINTED_SHAPES.get(hint_bytes)
    if num_ranks is None or (shape is not None and shape[2] == num_ranks):
        return shape
    fitting = [(hint, shape) for hint, shape in _HINTED_SHAPES.items() if shape[2] == num_ranks and hint <= hint_bytes]
    return max(fitting)[1] if fitting else None


def required_group_bytes(max_tokens_per_rank, hidden, topk, num_experts, low_latency, num_hosts, ranks_per_host,
                         num_sms=20):
    """(num_nvl_bytes, num_rdma_bytes) a group needs for this configuration (RequiredGroupBytes)."""
    c = _config(max_tokens_per_rank, hidden, topk, num_experts, num_sms, low_latency, 5.0)
    nvl, rdma = ctypes.c_uint64(), ctypes.c_uint64()
    call("epf_required_group_bytes", ctypes.byref(c), num_hosts, ranks_per_host, ctypes.byref(nvl), ctypes.byref(rdma))
    return nvl.value, rdma.value


def _fits(c, hosts, ranks_per_host, nvl_bytes, rdma_bytes):
    nvl, rdma = ctypes.c_uint64(), ctypes.c_uint64()
    if lib.epf_required_group_bytes(ctypes.byref(c), hosts, ranks_per_host, ctypes.byref(nvl), ctypes.byref(rdma)):
        return False
    return nvl.value <= nvl_bytes and rdma.value <= rdma_bytes


def _max_tokens(c, hosts, ranks_per_host, nvl_bytes, rdma_bytes):
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


def _record_event():
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


def _torch_layout(topk_idx, num_experts, num_ranks):
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
