"""DeepEP's small helper types, with the same names and behaviour: EventOverlap and Config."""
import torch


class EventOverlap:
    """A CUDA event recorded after an operation (async_finish=True), or None. `current_stream_wait()` makes the
    current stream wait for it; `with event:` does the same on exit, as DeepEP's. On the host backend every
    operation has finished when it returns, so the event is None and waiting does nothing."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()


class Config:
    """DeepEP's performance configuration. epfabric uses `num_sms` (channels of normal dispatch/combine); the chunk
    sizes are accepted for compatibility and not used (epfabric sizes its rings from the region)."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def __repr__(self):
        return f"Config(num_sms={self.num_sms})"
