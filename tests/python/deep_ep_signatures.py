"""DeepEP's public Python signatures, recorded from DeepEP's repository (deepseek-ai/DeepEP) for api_test.py, which
checks epfabric.deep_ep against them without the repository. Each entry: method -> its parameters as written there
("name" or "name=default", in order, without self); a leading "@" marks a staticmethod.

V1_2_1: deep_ep/buffer.py at tag v1.2.1. V1_EARLY_2026: deep_ep/buffer.py at 567632d (the last commit before DeepEP
2, with use_fabric and enable_shrink). LEGACY: deep_ep/buffers/legacy.py at dd758ca (DeepEP 2.1.0's Buffer).
ELASTIC_BUFFER and EP_HANDLE: deep_ep/buffers/elastic.py at dd758ca; EVENT_OVERLAP: deep_ep/utils/event.py;
FUNCTIONS: deep_ep/utils/envs.py; CONFIG and EVENT_HANDLE: the pybind11 bindings (csrc/legacy/buffer.hpp);
MODULE_NAMES: what deep_ep/__init__.py exports.
"""


V1_2_1 = {
    "__init__": (
        'group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24, '
        'allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False, comm=None'),
    "destroy": '',
    "is_sm90_compiled": '@',
    "set_num_sms": '@new_num_sms',
    "capture": '@',
    "get_low_latency_rdma_size_hint": '@num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts',
    "get_comm_stream": '',
    "get_local_buffer_tensor": 'dtype, size=None, offset=0, use_rdma_buffer=False',
    "get_dispatch_config": '@num_ranks',
    "get_combine_config": '@num_ranks',
    "get_dispatch_layout": (
        'topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False'),
    "dispatch": (
        'x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None, '
        'num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, '
        'config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False'),
    "combine": (
        'x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False, '
        'allocate_on_comm_stream=False'),
    "internode_dispatch": (
        'x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None, '
        'num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, config=None, '
        'previous_event=None, async_finish=False, allocate_on_comm_stream=False'),
    "internode_combine": (
        'x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False, '
        'allocate_on_comm_stream=False'),
    "clean_low_latency_buffer": 'num_max_dispatch_tokens_per_rank, hidden, num_experts',
    "low_latency_dispatch": (
        'x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats=None, '
        'dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, '
        'return_recv_hook=False'),
    "low_latency_combine": (
        'x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False, '
        'return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None'),
    "get_next_low_latency_combine_buffer": 'handle',
}

V1_EARLY_2026 = {
    "__init__": (
        'group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24, '
        'allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False, explicitly_destroy=False, '
        'enable_shrink=False, comm=None'),
    "destroy": '',
    "is_sm90_compiled": '@',
    "set_num_sms": '@new_num_sms',
    "capture": '@',
    "get_low_latency_rdma_size_hint": '@num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts',
    "get_comm_stream": '',
    "get_local_buffer_tensor": 'dtype, size=None, offset=0, use_rdma_buffer=False',
    "get_dispatch_config": '@num_ranks',
    "get_combine_config": '@num_ranks',
    "get_dispatch_layout": (
        'topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False'),
    "dispatch": (
        'x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None, '
        'num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, '
        'config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False'),
    "combine": (
        'x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False, '
        'allocate_on_comm_stream=False'),
    "internode_dispatch": (
        'x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None, '
        'num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, '
        'config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False'),
    "internode_combine": (
        'x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False, '
        'allocate_on_comm_stream=False'),
    "clean_low_latency_buffer": 'num_max_dispatch_tokens_per_rank, hidden, num_experts',
    "low_latency_dispatch": (
        'x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats=None, '
        'dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, '
        'return_recv_hook=False'),
    "low_latency_combine": (
        'x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False, '
        'return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None'),
    "low_latency_update_mask_buffer": 'rank_to_mask, mask=False',
    "low_latency_query_mask_buffer": 'mask_status',
    "low_latency_clean_mask_buffer": '',
    "get_next_low_latency_combine_buffer": 'handle',
}

LEGACY = {
    "__init__": (
        'group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24, '
        'allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False, enable_shrink=False, '
        'comm=None'),
    "destroy": '',
    "is_sm90_compiled": '@',
    "set_num_sms": '@new_num_sms',
    "capture": '@',
    "get_low_latency_rdma_size_hint": '@num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts',
    "get_comm_stream": '',
    "get_local_buffer_tensor": 'dtype, size=None, offset=0, use_rdma_buffer=False',
    "get_dispatch_config": '@num_ranks',
    "get_combine_config": '@num_ranks',
    "get_dispatch_layout": (
        'topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False'),
    "dispatch": (
        'x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None, '
        'num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, '
        'config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False'),
    "combine": (
        'x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False, '
        'allocate_on_comm_stream=False'),
    "internode_dispatch": (
        'x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None, '
        'num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, config=None, '
        'previous_event=None, async_finish=False, allocate_on_comm_stream=False'),
    "internode_combine": (
        'x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False, '
        'allocate_on_comm_stream=False'),
    "clean_low_latency_buffer": 'num_max_dispatch_tokens_per_rank, hidden, num_experts',
    "low_latency_dispatch": (
        'x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats=None, '
        'dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, '
        'return_recv_hook=False'),
    "low_latency_combine": (
        'x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False, '
        'return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None'),
    "low_latency_update_mask_buffer": 'rank_to_mask, mask=False',
    "low_latency_query_mask_buffer": 'mask_status',
    "low_latency_clean_mask_buffer": '',
    "get_next_low_latency_combine_buffer": 'handle',
}

ELASTIC_BUFFER = {
    "__init__": (
        'group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0, num_topk=0, '
        'use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True, allow_multiple_reduction=True, '
        'prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0, num_cpu_timeout_secs=300, '
        'num_gpu_timeout_secs=100, explicitly_destroy=False'),
    "destroy": '',
    "get_buffer_size_hint": (
        '@group, num_max_tokens_per_rank, hidden, num_topk=0, use_fp8_dispatch=False, allow_hybrid_mode=True, '
        'allow_multiple_reduction=True'),
    "get_engram_storage_size_hint": '@num_entries, hidden, num_max_tokens_per_rank, dtype=torch.bfloat16',
    "get_pp_buffer_size_hint": '@num_max_tensor_bytes, num_max_inflight_tensors',
    "get_agrs_num_max_session_bytes": '@group, shapes, dtype',
    "get_agrs_buffer_size_hint": '@group, num_max_session_bytes',
    "barrier": 'use_comm_stream=True, with_cpu_sync=False, sequential=True',
    "capture": '@',
    "get_comm_stream": '',
    "get_physical_domain_size": '',
    "get_logical_domain_size": '',
    "engram_write": 'storage, sf=None',
    "engram_fetch": 'indices, num_qps=0, use_tma_aligned_col_major_sf=False',
    "pp_set_config": 'num_max_tensor_bytes, num_max_inflight_tensors',
    "pp_send": 't, dst_rank_idx, num_sms=0',
    "pp_recv": 't, src_rank_idx, num_sms=0',
    "create_agrs_session": '',
    "destroy_agrs_session": '',
    "agrs_new_session": 'enabled=True',
    "agrs_set_config": 'num_max_session_bytes, num_max_all_gathers_per_session',
    "agrs_get_inplace_tensor": 'shapes, dtype',
    "all_gather": 't',
    "get_theoretical_num_sms": (
        'num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0, nvlink_gbs=0, sm_read_gbs=200, sm_write_gbs=50'),
    "get_theoretical_num_qps": 'num_sms',
    "dispatch": (
        'x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None, '
        'num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, previous_event=None, '
        'previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False, '
        'handle=None, do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False, '
        'use_tma_aligned_col_major_sf=False'),
    "combine": (
        'x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None, '
        'previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False'),
}

EP_HANDLE = {
    "__init__": (
        'do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx, num_recv_tokens, '
        'num_expanded_tokens, num_recv_tokens_per_expert_list, psum_num_recv_tokens_per_scaleup_rank, '
        'psum_num_recv_tokens_per_expert, num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx,'
        ' token_metadata_at_forward, channel_linked_list'),
    "deterministic_sort": (
        'do_cpu_sync, is_cached_dispatch, recv_x, recv_sf, recv_topk_idx, recv_topk_weights, channel_linked_list'),
}

EVENT_OVERLAP = {
    "__init__": 'event=None, extra_tensors=None',
    "current_stream_wait": 'release_handle=False',
    "register_hook_after_wait": 'hook_after_wait',
}

FUNCTIONS = {
    "get_physical_domain_size": 'group',
    "get_logical_domain_size": 'group, allow_hybrid_mode=True',
}

CONFIG = {
    "__init__": ("num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256, "
                 "num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256"),
    "get_nvl_buffer_size_hint": "hidden_bytes, num_ranks",
    "get_rdma_buffer_size_hint": "hidden_bytes, num_ranks",
}
EVENT_HANDLE = {"__init__": "", "current_stream_wait": ""}
MODULE_NAMES = ["Buffer", "ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "get_physical_domain_size",
                "get_logical_domain_size", "Config", "topk_idx_t", "__version__"]
