"""DeepEP's small helper types, with the same names and behaviour: EventHandle, EventOverlap and Config."""
from typing import Any, Callable, Optional, Tuple

import torch

from ._sizing import required_group_bytes


def record_event() -> Optional["torch.cuda.Event"]:
    """A CUDA event recorded on the current stream, or None where torch has no CUDA (the host backend: every call
    has finished when it returns, so there is nothing to wait for).

    Returns:
        event: the recorded event, or None.
    """
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


class EventHandle:
    """DeepEP V2's EventHandle: an event captured on the current stream when made."""

    def __init__(self) -> None:
        """Records an event on the current CUDA stream (nothing without CUDA)."""
        self.event = record_event()

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event (nothing without CUDA)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """A CUDA event recorded after an operation (async_finish=True, or V2's async_with_compute_stream=True), or None.
    `current_stream_wait()` makes the current stream wait for it; `with event:` does the same on exit, as DeepEP's.
    On the host backend every operation has finished when it returns, so the event is None and waiting does nothing
    (DeepEP asserts there; this runs the hook registered after the wait and returns).

    Attributes:
        event: the CUDA event (a torch.cuda.Event or an EventHandle), or None.
        extra_tensors: tensors kept alive with the event.
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        """Wraps an event.

        Arguments:
            event: the event captured (torch.cuda.Event or EventHandle), or None.
            extra_tensors: tensors to keep alive until the event is released.
        """
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Optional[Callable[[], Any]] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Makes the current stream wait for the event, then runs the hook registered after the wait.

        Arguments:
            release_handle: drop the event afterwards (DeepEP V2).
        """
        if self.event is not None:
            if isinstance(self.event, EventHandle):
                self.event.current_stream_wait()
            else:
                torch.cuda.current_stream().wait_event(self.event)
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Registers a hook that current_stream_wait() runs once after the wait (DeepEP V2).

        Arguments:
            hook_after_wait: the hook.
        """
        if self.hook_after_wait is not None:
            raise RuntimeError("a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """`with event(release_handle=True):` drops the event after the wait on exit (DeepEP V2).

        Arguments:
            release_handle: whether the exit drops the event.

        Returns:
            self.
        """
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class Config:
    """DeepEP's performance configuration. epfabric uses `num_sms` (channels of normal dispatch/combine); the chunk
    sizes are accepted for compatibility and not used (epfabric sizes its rings from the region)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP: the NVL bytes normal mode needs for rows of `hidden_bytes`. epfabric sizes its normal-mode
        region by tokens per rank, not by chunks: this is what a group of `num_ranks` ranks on one host needs for
        num_max_nvl_chunked_recv_tokens tokens per rank of that row size, top-8 of 256 experts (rounded up to a
        multiple of the ranks), the configuration's SMs.

        Arguments:
            hidden_bytes: the bytes of a row (hidden x element size).
            num_ranks: the number of ranks.

        Returns:
            size: bytes of each rank's NVL region.
        """
        experts = -(-256 // num_ranks) * num_ranks
        hidden = max(8, -(-(hidden_bytes // 2) // 8) * 8)
        return required_group_bytes(self.num_max_nvl_chunked_recv_tokens, hidden, 8, experts, False, 1, num_ranks,
                                    self.num_sms)[0]

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP: the RDMA bytes normal mode across hosts needs. As get_nvl_buffer_size_hint, for `num_ranks` ranks
        on hosts of 8 (DeepEP's NVL domain), num_max_rdma_chunked_recv_tokens tokens per rank; 0 within one host.

        Arguments:
            hidden_bytes: the bytes of a row (hidden x element size).
            num_ranks: the number of ranks.

        Returns:
            size: bytes of each rank's RDMA region.
        """
        if num_ranks <= 8:
            return 0
        hosts = -(-num_ranks // 8)
        experts = -(-256 // (hosts * 8)) * hosts * 8
        hidden = max(8, -(-(hidden_bytes // 2) // 8) * 8)
        return required_group_bytes(self.num_max_rdma_chunked_recv_tokens, hidden, 8, experts, False, hosts, 8,
                                    self.num_sms)[1]

    def __repr__(self) -> str:
        return f"Config(num_sms={self.num_sms})"
