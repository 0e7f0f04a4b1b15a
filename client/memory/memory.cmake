# Client side of daemon-owned regions: map POSIX shm, CUDA IPC and cuMem POSIX-fd regions into this process.
add_library(epfabric_client_memory STATIC ${CMAKE_CURRENT_LIST_DIR}/region_import.cc)
target_include_directories(epfabric_client_memory PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(epfabric_client_memory
    PUBLIC epfabric_proto absl::status absl::statusor
    PRIVATE epfabric_cuda_driver epfabric_common absl::cleanup absl::strings)
