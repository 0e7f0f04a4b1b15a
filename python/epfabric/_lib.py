"""ctypes declarations of libepfabric_client.so's C ABI (client/include/epfabric/epfabric.h).

The library is found, in order, at $EPFABRIC_LIBRARY, next to this package (an installed tree), in the source
tree's build directory ($EPF_BUILD_DIR or build/), then by the dynamic loader's search path. Nothing here is compiled
against Python or torch: any CPython >= 3.9 can load it.
"""
import ctypes
import os
import pathlib

ABI_VERSION = 1
ABI_MINOR_VERSION = 10  # the additions to ABI 1 this package calls (epfabric.h, EPF_ABI_MINOR_VERSION)
MAX_DIMS = 4

BF16, FP8_E4M3, FLOAT32, INT32, INT64, BOOL = range(6)
BACKEND_CUDA, BACKEND_HOST = 1, 2

_STATUS_NAMES = {
    1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION", 10: "ABORTED",
    11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS",
}


class EpfError(RuntimeError):
    """A failed epfabric call: `code` is the gRPC/absl status code, `code_name` its name (e.g. DEADLINE_EXCEEDED)."""

    def __init__(self, code, message, call):
        self.code = code
        self.code_name = _STATUS_NAMES.get(code, str(code))
        self.call = call
        super().__init__(f"{call}: {self.code_name}: {message}")


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.c_int64 * MAX_DIMS)]


class BufferConfig(ctypes.Structure):
    _fields_ = [("max_tokens_per_rank", ctypes.c_int32), ("hidden", ctypes.c_int32), ("max_topk", ctypes.c_int32),
                ("num_experts", ctypes.c_int32), ("num_sms", ctypes.c_int32), ("low_latency", ctypes.c_int32),
                ("timeout_s", ctypes.c_double), ("low_latency_sms", ctypes.c_int32)]


class Layout(ctypes.Structure):
    _fields_ = [("num_tokens_per_rank", Tensor), ("num_tokens_per_expert", Tensor), ("is_token_in_rank", Tensor),
                ("num_invalid_topk", Tensor), ("keep", ctypes.c_void_p)]


class DispatchArgs(ctypes.Structure):
    _fields_ = [("x", Tensor), ("x_scales", Tensor), ("topk_idx", Tensor), ("topk_weights", Tensor),
                ("layout", ctypes.POINTER(Layout)), ("cached", ctypes.c_void_p), ("expert_alignment", ctypes.c_int32)]


class DispatchOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("num_worst_tokens", ctypes.c_int32)]


class DispatchResult(ctypes.Structure):
    _fields_ = [("recv_x", Tensor), ("recv_x_scales", Tensor), ("recv_topk_idx", Tensor),
                ("recv_topk_weights", Tensor), ("num_recv_tokens", ctypes.c_int32),
                ("num_local_experts", ctypes.c_int32), ("num_recv_tokens_per_expert", ctypes.POINTER(ctypes.c_int32)),
                ("num_local_experts_capacity", ctypes.c_int32), ("handle", ctypes.c_void_p)]


class CombineArgs(ctypes.Structure):
    _fields_ = [("x", Tensor), ("topk_weights", Tensor), ("bias_0", Tensor), ("bias_1", Tensor),
                ("handle", ctypes.c_void_p)]


class CombineResult(ctypes.Structure):
    _fields_ = [("combined_x", Tensor), ("combined_topk_weights", Tensor)]


class LLDispatchArgs(ctypes.Structure):
    _fields_ = [("x", Tensor), ("topk_idx", Tensor), ("cumulative_stats", Tensor), ("use_fp8", ctypes.c_int32),
                ("round_scale", ctypes.c_int32), ("use_ue8m0", ctypes.c_int32), ("return_recv_hook", ctypes.c_int32)]


class LLDispatchResult(ctypes.Structure):
    _fields_ = [("packed_recv_x", Tensor), ("packed_recv_x_scales", Tensor), ("packed_recv_count", Tensor),
                ("packed_recv_src_info", Tensor), ("packed_recv_layout_range", Tensor), ("handle", ctypes.c_void_p),
                ("hook", ctypes.c_void_p)]


class LLCombineArgs(ctypes.Structure):
    _fields_ = [("x", Tensor), ("topk_idx", Tensor), ("topk_weights", Tensor), ("handle", ctypes.c_void_p),
                ("zero_copy", ctypes.c_int32), ("return_recv_hook", ctypes.c_int32), ("out", Tensor)]


class LLOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("wait_recv_cost_stats", Tensor)]


class LLCombineResult(ctypes.Structure):
    _fields_ = [("combined_x", Tensor), ("hook", ctypes.c_void_p)]


ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
ALLOC_TENSOR_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                   ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.c_void_p)


class AllocatorCallbacks(ctypes.Structure):  # epf_allocator
    _fields_ = [("struct_size", ctypes.c_uint32), ("alloc", ALLOC_FN), ("free_fn", FREE_FN), ("ctx", ctypes.c_void_p),
                ("alloc_tensor", ALLOC_TENSOR_FN)]


class BufferOptions(ctypes.Structure):  # epf_buffer_options
    _fields_ = [("struct_size", ctypes.c_uint32), ("low_latency_issue", ctypes.c_int32),
                ("enable_shrink", ctypes.c_int32)]


# epf_buffer_options.low_latency_issue (EPF_LL_ISSUE_*): who puts low latency's bytes for ranks on other hosts.
LOW_LATENCY_ISSUE = {"auto": 0, "relay": 1, "device": 2}


class GroupOptions(ctypes.Structure):  # epf_group_options
    _fields_ = [("struct_size", ctypes.c_uint32), ("num_normal_bytes", ctypes.c_uint64),
                ("num_normal_rdma_bytes", ctypes.c_uint64), ("transport_channels", ctypes.c_uint32),
                ("ring_slots", ctypes.c_uint32)]


_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_I = ctypes.c_int
_S = ctypes.c_int32
# name: (restype, argtypes); restype _S is an epf_status checked by call().
_SIGNATURES = {
    "epf_version": (ctypes.c_char_p, []),
    "epf_abi_version": (_I, []),
    "epf_abi_minor_version": (_I, []),
    "epf_last_error": (ctypes.c_char_p, []),
    "epf_client_connect": (_S, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double, _PP]),
    "epf_client_destroy": (None, [_P]),
    "epf_client_daemon_info": (_S, [_P] + [ctypes.POINTER(ctypes.c_int32)] * 4),
    "epf_client_host_id": (_S, [_P, ctypes.c_char_p, ctypes.c_size_t]),
    "epf_create_group": (_S, [_P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int32), _I, ctypes.c_uint64,
                              ctypes.c_uint64, _I, ctypes.c_char_p, ctypes.c_size_t]),
    "epf_create_group_ex": (_S, [_P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int32), _I, ctypes.c_uint64,
                                 ctypes.c_uint64, _I, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]),
    "epf_create_group_opts": (_S, [_P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int32), _I, ctypes.c_uint64,
                                   ctypes.c_uint64, _I, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]),
    "epf_delete_group": (_S, [_P, ctypes.c_char_p, ctypes.c_char_p]),
    "epf_attach": (_S, [_P, ctypes.c_char_p, _I, ctypes.c_char_p, _I, _PP]),
    "epf_lease_detach": (_S, [_P]),
    "epf_lease_destroy": (None, [_P]),
    "epf_lease_rank": (_I, [_P]),
    "epf_lease_world_size": (_I, [_P]),
    "epf_lease_backend": (_I, [_P]),
    "epf_lease_low_latency": (_I, [_P]),
    "epf_lease_num_normal_bytes": (ctypes.c_uint64, [_P]),
    "epf_lease_num_normal_rdma_bytes": (ctypes.c_uint64, [_P]),
    "epf_lease_group_bytes": (_S, [_P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]),
    "epf_lease_num_nvl_ranks": (_I, [_P]),
    "epf_lease_healthy": (_S, [_P]),
    "epf_lease_region": (_S, [_P, _I, _PP, ctypes.POINTER(ctypes.c_uint64)]),
    "epf_required_group_bytes": (_S, [ctypes.POINTER(BufferConfig), _I, _I, ctypes.POINTER(ctypes.c_uint64),
                                      ctypes.POINTER(ctypes.c_uint64)]),
    "epf_buffer_create": (_S, [_P, ctypes.POINTER(BufferConfig), ALLOC_FN, FREE_FN, _P, _PP]),
    "epf_buffer_create_ex": (_S, [_P, ctypes.POINTER(BufferConfig), ctypes.POINTER(AllocatorCallbacks), _PP]),
    "epf_buffer_create_opts": (_S, [_P, ctypes.POINTER(BufferConfig), ctypes.POINTER(AllocatorCallbacks),
                                    ctypes.POINTER(BufferOptions), _PP]),
    "epf_buffer_destroy": (None, [_P]),
    "epf_buffer_check": (_S, [_P, _P]),
    "epf_buffer_reset": (_S, [_P, _P]),
    "epf_get_dispatch_layout": (_S, [_P, ctypes.POINTER(Tensor), _P, ctypes.POINTER(Layout)]),
    "epf_layout_release": (None, [ctypes.POINTER(Layout)]),
    "epf_dispatch": (_S, [_P, ctypes.POINTER(DispatchArgs), _P, ctypes.POINTER(DispatchResult)]),
    "epf_dispatch_ex": (_S, [_P, ctypes.POINTER(DispatchArgs), ctypes.POINTER(DispatchOptions), _P,
                             ctypes.POINTER(DispatchResult)]),
    "epf_dispatch_handle_destroy": (None, [_P]),
    "epf_dispatch_handle_rank_prefix_matrix": (_S, [_P, _P]),
    "epf_combine": (_S, [_P, ctypes.POINTER(CombineArgs), _P, ctypes.POINTER(CombineResult)]),
    "epf_low_latency_dispatch": (_S, [_P, ctypes.POINTER(LLDispatchArgs), _P, ctypes.POINTER(LLDispatchResult)]),
    "epf_ll_handle_destroy": (None, [_P]),
    "epf_low_latency_combine": (_S, [_P, ctypes.POINTER(LLCombineArgs), _P, ctypes.POINTER(LLCombineResult)]),
    "epf_low_latency_dispatch_ex": (_S, [_P, ctypes.POINTER(LLDispatchArgs), ctypes.POINTER(LLOptions), _P,
                                         ctypes.POINTER(LLDispatchResult)]),
    "epf_low_latency_combine_ex": (_S, [_P, ctypes.POINTER(LLCombineArgs), ctypes.POINTER(LLOptions), _P,
                                        ctypes.POINTER(LLCombineResult)]),
    "epf_hook_run": (_S, [_P, _P]),
    "epf_hook_destroy": (None, [_P]),
    "epf_next_low_latency_combine_buffer": (_S, [_P, ctypes.POINTER(Tensor)]),
    "epf_low_latency_rank_mask": (_S, [_P, ctypes.POINTER(Tensor)]),
}


def _candidates():
    env = os.environ.get("EPFABRIC_LIBRARY")
    if env:
        yield pathlib.Path(env)
        return
    here = pathlib.Path(__file__).resolve().parent
    yield here / "libepfabric_client.so"
    yield here.parents[2] / "libepfabric_client.so"  # installed: PREFIX/lib/python3/dist-packages/epfabric
    root = here.parent.parent  # the source tree: python/epfabric -> .
    build = pathlib.Path(os.environ.get("EPF_BUILD_DIR", root / "build"))
    yield build / "client" / "libepfabric_client.so"


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.exists():
            lib = ctypes.CDLL(str(path))
            break
    else:
        try:
            lib = ctypes.CDLL("libepfabric_client.so")
        except OSError as error:
            raise ImportError(f"libepfabric_client.so not found (tried {', '.join(tried)} and the loader's path; "
                              f"set EPFABRIC_LIBRARY): {error}") from None
    abi = lib.epf_abi_version()
    minor = lib.epf_abi_minor_version() if hasattr(lib, "epf_abi_minor_version") else 0
    if abi != ABI_VERSION or minor < ABI_MINOR_VERSION:
        raise ImportError(f"libepfabric_client.so has C ABI {abi}.{minor}, this package needs "
                          f"{ABI_VERSION}.{ABI_MINOR_VERSION} or a later {ABI_VERSION}.x")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


lib = _load()


def call(name, *args):
    """Calls epf_<name>; raises EpfError with the library's message when it fails."""
    status = getattr(lib, name)(*args)
    if status != 0:
        raise EpfError(status, lib.epf_last_error().decode(errors="replace"), name)


def fail(status, name):
    """The EpfError of a failed call whose status the caller checked itself (the hot paths call the functions
    directly)."""
    return EpfError(status, lib.epf_last_error().decode(errors="replace"), name)


def version():
    return lib.epf_version().decode()
