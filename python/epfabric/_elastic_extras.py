"""The DeepEP 2 ElasticBuffer calls outside expert-parallel dispatch/combine: the size hints of its pipeline-parallel,
all-gather/reduce-scatter and Engram features (DeepEP 2's arithmetic), and those features' calls, which need memory
and transfers the epfabric daemons do not give to Python: they raise NotImplementedError naming the call."""
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

from ._words import align

_ALIGNMENT = 2 << 20  # DeepEP 2's buffer sizes are multiples of 2 MiB


class ElasticExtrasMixin:
    """ElasticBuffer's size hints and refused calls."""

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
        """DeepEP 2's Engram sizes: entries of `hidden` elements in 32-byte units, 2 MiB-aligned (the Engram calls
        themselves are not provided).

        Returns:
            num_gpu_bytes: the receive area for num_max_tokens_per_rank entries.
            num_cpu_bytes: the storage of num_entries entries.
        """
        entry = align(hidden * torch.empty((), dtype=dtype).element_size(), 32)
        gpu_bytes = align(entry * num_max_tokens_per_rank, _ALIGNMENT)
        return gpu_bytes, align(entry * num_entries, _ALIGNMENT)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """DeepEP 2's pipeline-parallel size: send and receive areas for both ring neighbours, 2 MiB-aligned (the PP
        calls themselves are not provided).

        Returns:
            size: bytes.
        """
        return align(align(num_max_tensor_bytes, 32) * num_max_inflight_tensors * 4, _ALIGNMENT)

    @staticmethod
    def get_agrs_num_max_session_bytes(group: Any, shapes: Union[Tuple[int, ...], torch.Size,
                                                                 Sequence[Union[Tuple[int, ...], torch.Size]]],
                                       dtype: torch.dtype) -> int:
        """DeepEP 2's all-gather session bytes: every rank's tensors, each rounded up to 32 bytes.

        Returns:
            size: bytes.
        """
        if not isinstance(shapes[0], (tuple, torch.Size)):
            shapes = (shapes,)
        element = torch.empty((), dtype=dtype).element_size()
        total = 0
        for shape in shapes:
            count = 1
            for dim in shape:
                count *= dim
            total += align(group.size() * count * element, 32)
        return total

    @staticmethod
    def get_agrs_buffer_size_hint(group: Any, num_max_session_bytes: int) -> int:
        """DeepEP 2's all-gather buffer size: the session bytes, 2 MiB-aligned.

        Returns:
            size: bytes.
        """
        return align(num_max_session_bytes, _ALIGNMENT)

    # ---- DeepEP 2 calls that need memory epfabric does not provide ----

    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None) -> None:
        """Not provided: DeepEP 2's Engram storage lives in host memory registered for RDMA gets."""
        _refuse("engram_write", "Engram (remote KV storage fetched by RDMA gets)")

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0,
                     use_tma_aligned_col_major_sf: bool = False) -> Callable:
        """Not provided: DeepEP 2's Engram fetch."""
        _refuse("engram_fetch", "Engram (remote KV storage fetched by RDMA gets)")

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Not provided: DeepEP 2's pipeline-parallel send/recv."""
        _refuse("pp_set_config", "pipeline-parallel send/recv")

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Not provided: DeepEP 2's pipeline-parallel send."""
        _refuse("pp_send", "pipeline-parallel send/recv")

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Not provided: DeepEP 2's pipeline-parallel receive."""
        _refuse("pp_recv", "pipeline-parallel send/recv")

    def create_agrs_session(self) -> None:
        """Not provided: DeepEP 2's all-gather/reduce-scatter sessions."""
        _refuse("create_agrs_session", "all-gather/reduce-scatter sessions")

    def destroy_agrs_session(self) -> None:
        """Not provided: DeepEP 2's all-gather/reduce-scatter sessions."""
        _refuse("destroy_agrs_session", "all-gather/reduce-scatter sessions")

    def agrs_new_session(self, enabled: bool = True) -> Any:
        """Not provided: DeepEP 2's all-gather/reduce-scatter sessions."""
        _refuse("agrs_new_session", "all-gather/reduce-scatter sessions")

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Not provided: DeepEP 2's all-gather/reduce-scatter sessions."""
        _refuse("agrs_set_config", "all-gather/reduce-scatter sessions")

    def agrs_get_inplace_tensor(self, shapes: Any, dtype: torch.dtype) -> Any:
        """Not provided: DeepEP 2's all-gather/reduce-scatter sessions."""
        _refuse("agrs_get_inplace_tensor", "all-gather/reduce-scatter sessions")

    def all_gather(self, t: Union[torch.Tensor, Sequence[torch.Tensor]]) -> Any:
        """Not provided: DeepEP 2's all-gather over symmetric memory."""
        _refuse("all_gather", "all-gather/reduce-scatter sessions")


def _refuse(name: str, what: str) -> None:
    raise NotImplementedError(f"epfabric: ElasticBuffer.{name} is not provided: DeepEP 2's {what} need memory and "
                              "transfers the epfabric daemons do not give to Python (docs/python.md)")
