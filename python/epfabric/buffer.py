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
from typing import Dict, Optional, Tuple, Union

import torch

from . import _lib, _tensors
from ._calls import _Calls
from ._handles import DispatchHandle, LowLatencyHandle, UnavailableField  # noqa: F401 (re-exported)
from ._lib import call, lib
from ._sizing import _HINTED_SHAPES, low_latency_shape_of, required_group_bytes  # noqa: F401 (re-exported)
from .client import Client
from .low_latency import LowLatencyMixin
from .normal import NormalMixin
from .utils import Config, EventOverlap, record_event

_NO_EVENT = EventOverlap()  # what calls without async_finish return: it holds nothing, so one serves every call
# The calling thread's current stream on a device as a raw handle: torch's own accessor (0.1 us on an H100 against
# 3.3 us for torch.cuda.current_stream(device).cuda_stream, bench/python_call_breakdown.py); absent in CPU-only builds.
_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _issue_code(low_latency_issue: str) -> int:
    """epf_buffer_options.low_latency_issue for Buffer's low_latency_issue argument."""
    if low_latency_issue not in _lib.LOW_LATENCY_ISSUE:
        choices = ", ".join(_lib.LOW_LATENCY_ISSUE)
        raise ValueError(f"low_latency_issue={low_latency_issue!r}: expected one of {choices}")
    return _lib.LOW_LATENCY_ISSUE[low_latency_issue]


class Buffer(NormalMixin, LowLatencyMixin):
    """A lease of one rank of a daemon-owned group, with DeepEP's Buffer calls: normal mode (normal.py) and low
    latency (low_latency.py). Attributes: rank, group_size, num_nvl_ranks (ranks per host), low_latency_mode,
    normal_mode, num_nvl_bytes, num_rdma_bytes, num_normal_bytes, num_normal_rdma_bytes, device."""

    num_sms = 20  # DeepEP's class-wide SM count (set_num_sms)

    def __init__(self, client: Client, lease: ctypes.c_void_p, *, timeout_s: float = 5.0, num_sms: Optional[int] = None,
                 low_latency_sms: int = 0, low_latency_issue: str = "auto", enable_shrink: bool = False) -> None:
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
        # The sizes the group was created with, the same on every rank and backend (a mapped region may be larger:
        # cuda rounds it up to its allocation granularity). Every decision about what a call fits is made from these,
        # so every rank makes the same one.
        nvl, rdma = ctypes.c_uint64(), ctypes.c_uint64()
        call("epf_lease_group_bytes", lease, ctypes.byref(nvl), ctypes.byref(rdma))
        self.num_nvl_bytes, self.num_rdma_bytes = nvl.value, rdma.value

    @classmethod
    def attach(cls, socket: str, group: str, rank: int, token: str, *, timeout_s: float = 5.0,
               num_sms: Optional[int] = None, low_latency_sms: int = 0, low_latency_issue: str = "auto",
               client_name: str = "epfabric-python", enable_shrink: bool = False) -> "Buffer":
        """Attaches group rank `rank` of `group` through the daemon at `socket` (the daemon that serves that rank).
        On cuda groups the current CUDA device is the one whose kernels use the regions. num_sms: normal mode's SMs
        (default Buffer.num_sms); low_latency_sms: low-latency blocks per launch (0: every SM; ranks sharing a GPU
        in one process each need a share). low_latency_issue: who puts low latency's bytes for ranks on other hosts
        on cuda: "device" (kernels; capturable into CUDA graphs), "relay" (the calling thread between launches), or
        "auto" (device on the verbs wire, relay on the socket wire, unless EPF_LOW_LATENCY_ISSUE says).

        Returns:
            buffer: the attached Buffer; its calls set up C Buffers for their shapes.
        """
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
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SMs (channels) of normal-mode calls for every Buffer made afterwards without num_sms, as DeepEP's.

        Arguments:
            new_num_sms: the new SM count.
        """
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (DeepEP's capture), for previous_event.

        Returns:
            event: the captured event; on the host backend one that holds nothing (every call has finished when it
                returns).
        """
        return EventOverlap(record_event())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The normal-mode configuration DeepEP recommends for `num_ranks`; epfabric's uses Buffer.num_sms SMs.

        Arguments:
            num_ranks: the number of ranks.

        Returns:
            config: the configuration.
        """
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """As get_dispatch_config, for combine.

        Arguments:
            num_ranks: the number of ranks.

        Returns:
            config: the configuration.
        """
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of region a low-latency group of `num_ranks` ranks on one host needs (CreateGroup's num_nvl_bytes;
        epfabric.deep_ep passes it as DeepEP's num_rdma_bytes). The shape is remembered, so that a drop-in Buffer
        given this size for a group across hosts can size its RDMA region exactly (low_latency_shape_of).

        Arguments:
            num_max_dispatch_tokens_per_rank: the most tokens a rank dispatches in one call.
            hidden: the hidden size.
            num_ranks: the number of ranks.
            num_experts: the number of experts.

        Returns:
            size: the bytes of each rank's region.
        """
        hint = required_group_bytes(num_max_dispatch_tokens_per_rank, hidden, 9, num_experts, True, 1, num_ranks)[0]
        _HINTED_SHAPES[hint] = (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        return hint

    # ---- lifetime ----

    def destroy(self) -> None:
        """Releases the Buffer and the lease (the daemon zeroes this rank's region for the next client)."""
        self._release()

    def _release(self) -> None:
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

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """epfabric launches on the caller's stream: this is the current stream.

        Returns:
            stream: the current CUDA stream, or None on the host backend.
        """
        return torch.cuda.current_stream() if self.device.type == "cuda" else None

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[Union[torch.Size, Tuple[int, ...]]] = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's region (or RDMA region) as a tensor.

        Arguments:
            dtype: the tensor's dtype.
            size: its shape (None: the whole region from `offset`, one dimension).
            offset: the byte where it starts.
            use_rdma_buffer: the RDMA region instead of the NVL one.

        Returns:
            tensor: a view of the region (no copy).
        """
        data, mapped = ctypes.c_void_p(), ctypes.c_uint64()
        call("epf_lease_region", self._live_lease(), int(bool(use_rdma_buffer)), ctypes.byref(data),
             ctypes.byref(mapped))
        # The group's size (what DeepEP's buffer has), not the mapping's, which cuda rounds up.
        nbytes = min(mapped.value, self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes)
        if offset < 0 or offset > nbytes:
            raise ValueError(f"offset = {offset}: the region has {nbytes} bytes")
        raw = _tensors.from_pointer(data.value + offset, nbytes - offset, self.device)
        element = torch.empty((), dtype=dtype).element_size()
        t = raw[:(raw.numel() // element) * element].view(dtype)
        if size is None:
            return t
        size = torch.Size(size)
        if size.numel() > t.numel():
            raise ValueError(f"size {tuple(size)} needs {size.numel() * element} bytes; the region has "
                             f"{t.numel() * element} from offset {offset}")
        return t[:size.numel()].view(size)

    # ---- errors and recovery ----

    def check(self) -> None:
        """cuda: waits for the current stream and reports a kernel's timeout (DEADLINE_EXCEEDED naming the rank)."""
        for cbuf in (self._cbuf, self._ll_cbuf):
            if cbuf is not None:
                call("epf_buffer_check", cbuf, self._stream())

    def reset(self) -> None:
        """After a timeout: every rank calls reset() (nothing of the group in flight) before the next operation."""
        for cbuf in (self._cbuf, self._ll_cbuf):
            if cbuf is not None:
                call("epf_buffer_reset", cbuf, self._stream())

    # ---- internals ----

    def _live_lease(self):
        if self._lease is None:
            raise RuntimeError("this Buffer was destroyed")
        return self._lease

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
        return EventOverlap(record_event()) if async_finish and self._dev_index >= 0 else _NO_EVENT

    def _new_cbuf(self, config):
        cbuf = ctypes.c_void_p()
        options = _lib.BufferOptions(ctypes.sizeof(_lib.BufferOptions), self._low_latency_issue,
                                     int(self._enable_shrink))
        call("epf_buffer_create_opts", self._live_lease(), ctypes.byref(config), ctypes.byref(self._alloc.callbacks),
             ctypes.byref(options), ctypes.byref(cbuf))
        return cbuf

    def _sync_ranks(self) -> bool:
        """Waits until every rank of the group has reached this point with nothing of the group in flight (the
        replacement of a C Buffer, see _renew). epfabric.Buffer has no channel between its ranks but the library's
        kernels, so it cannot: False. epfabric.deep_ep.Buffer waits on its process group.

        Returns:
            whether the ranks were synchronized.
        """
        return False

    def _agree_max(self, value: int) -> int:
        """The largest `value` over the ranks of the group, for decisions every rank must make alike (the shape of a
        new C Buffer). epfabric.Buffer has no channel between its ranks: this rank's own. epfabric.deep_ep.Buffer
        gathers it over its process group.

        Arguments:
            value: this rank's value.

        Returns:
            the largest over the ranks.
        """
        return value

    def _renew(self, name: str, config: "_lib.BufferConfig", shape: Dict[str, int]) -> None:
        """Makes the C Buffer of attribute `name` (`_cbuf` or `_ll_cbuf`) for `config`, replacing the one there.

        Every rank replaces its C Buffer at the same call (they see the same sequence of shapes, as in DeepEP's usage),
        so: the ranks synchronize (nothing of the group in flight), each destroys its old C Buffer, makes the new one
        and resets it (the new layout's signals in its own region are zeroed), and the ranks synchronize again before
        anyone writes into a peer's region. The first C Buffer of a mode needs no reset (the daemon zeroed the region
        when the lease started), but the ranks still synchronize after making it: making one allocates device and
        pinned memory and loads kernels, which, for ranks that share a GPU as threads of one process, would keep this
        rank's kernels from running beside a peer's first kernel that already waits for them (until its timeout).

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
