# The verbs wire (TRANSPORT_VERBS): rdma-core RC queue pairs, DMA-BUF / peermem registration of GPU memory.
# A library of its own so that its logic is unit-tested without the daemon and without a NIC; epfabric_daemon
# links it (transport/wire.h is the interface it implements).
add_library(epfabric_transport_verbs STATIC
    ${CMAKE_CURRENT_LIST_DIR}/send_queue.cc
    ${CMAKE_CURRENT_LIST_DIR}/verbs_logic.cc
    ${CMAKE_CURRENT_LIST_DIR}/verbs_probe.cc
    ${CMAKE_CURRENT_LIST_DIR}/verbs_resources.cc
    ${CMAKE_CURRENT_LIST_DIR}/verbs_wire.cc)
# Includes are rooted at daemon/ ("transport/wire.h", "memory/region.h"); the ring format is the kernels' ABI.
target_include_directories(epfabric_transport_verbs PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(epfabric_transport_verbs
    PUBLIC epfabric_proto PkgConfig::IBVERBS absl::status absl::statusor absl::time absl::synchronization
           absl::function_ref
    PRIVATE epfabric_kernels_abi epfabric_cuda_driver epfabric_status_macros spdlog::spdlog absl::strings absl::str_format absl::cleanup)
