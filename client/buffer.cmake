# The data-path API (Buffer: layout, dispatch, combine, low latency) over a Lease. Plain C++: it calls the kernels
# library's host-callable launch functions (cuda backend) or its host backend.
add_library(epfabric_buffer STATIC ${CMAKE_CURRENT_LIST_DIR}/buffer.cc)
target_include_directories(epfabric_buffer PUBLIC ${CMAKE_CURRENT_LIST_DIR}/include)
target_link_libraries(epfabric_buffer
    PUBLIC epfabric_client epfabric_kernels CUDA::cudart_static absl::status absl::statusor absl::time
    PRIVATE absl::strings absl::str_format)
