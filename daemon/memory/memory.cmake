# Region memory: POSIX shared memory (host backend) and CUDA device memory shared as CUDA IPC handles or as cuMem
# allocations exported as POSIX file descriptors (cuda backend). Driver entry points come from
# epfabric_cuda_driver, so the daemon does not link libcuda.
target_sources(epfabric_daemon PRIVATE
    ${CMAKE_CURRENT_LIST_DIR}/region_common.cc
    ${CMAKE_CURRENT_LIST_DIR}/host_region.cc
    ${CMAKE_CURRENT_LIST_DIR}/cuda_region.cc)
target_link_libraries(epfabric_daemon PRIVATE epfabric_cuda_driver epfabric_common absl::cleanup absl::strings absl::flat_hash_set absl::synchronization)
