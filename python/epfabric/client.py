"""Group management and daemon facts over a daemon's client socket (the Control and Ops services)."""
import ctypes
import time
from dataclasses import dataclass

from . import _lib
from ._lib import EpfError, call, lib


class Client:
    """A connection to one daemon (its --client_socket). Closed by close() or when collected."""

    def __init__(self, socket, timeout_s=5.0, client_name="epfabric-python"):
        self.socket = socket
        handle = ctypes.c_void_p()
        call("epf_client_connect", socket.encode(), client_name.encode(), float(timeout_s), ctypes.byref(handle))
        self._handle = handle

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError(f"the client of {self.socket} is closed")
        return self._handle

    def close(self):
        if getattr(self, "_handle", None) is not None:
            lib.epf_client_destroy(self._handle)
            self._handle = None

    def __del__(self):
        if _lib is not None and lib is not None:
            self.close()

    def daemon_info(self):
        out = [ctypes.c_int32() for _ in range(4)]
        call("epf_client_daemon_info", self.handle, *[ctypes.byref(o) for o in out])
        return DaemonInfo(*[o.value for o in out])

    def host_id(self):
        """The daemon's host id: daemons with equal ids share a host (a group over them spans as many hosts as there
        are distinct ids)."""
        out = ctypes.create_string_buffer(256)
        call("epf_client_host_id", self.handle, out, len(out))
        return out.value.decode()

    def create_group(self, name, fabric_ranks, num_nvl_bytes, num_rdma_bytes=0, low_latency=False,
                     num_normal_bytes=0, num_normal_rdma_bytes=0):
        """Creates group `name` over `fabric_ranks` (group rank i = fabric_ranks[i]); returns its token (shown only
        once: keep it, it is needed to attach and to delete). num_normal_bytes > 0 (low_latency): the group serves
        both modes, normal mode in the first num_normal_bytes of each NVL region (a multiple of 4096), and with
        num_rdma_bytes > 0 (across hosts) in the first num_normal_rdma_bytes of each RDMA region."""
        ranks = (ctypes.c_int32 * len(fabric_ranks))(*fabric_ranks)
        token = ctypes.create_string_buffer(256)
        options = _lib.GroupOptions(struct_size=ctypes.sizeof(_lib.GroupOptions),
                                    num_normal_bytes=int(num_normal_bytes),
                                    num_normal_rdma_bytes=int(num_normal_rdma_bytes))
        for attempt in range(6):
            try:
                call("epf_create_group_opts", self.handle, name.encode(), ranks, len(fabric_ranks), int(num_nvl_bytes),
                     int(num_rdma_bytes), int(bool(low_latency)), ctypes.byref(options), token, len(token))
                return token.value.decode()
            except EpfError as error:
                # ABORTED: membership changed while the group was prepared (e.g. a daemon just joined); the
                # daemon rolled it back and asks for a retry.
                if error.code_name != "ABORTED" or attempt == 5:
                    raise
                time.sleep(0.05 * 2 ** attempt)

    def delete_group(self, name, token):
        call("epf_delete_group", self.handle, name.encode(), token.encode())


@dataclass
class DaemonInfo:
    fabric_rank: int
    world_size: int
    backend: int  # _lib.BACKEND_CUDA or _lib.BACKEND_HOST
    device: int   # -1 on the host backend
