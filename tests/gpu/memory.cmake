# Cuda regions shared with a separate process, both ways (CUDA IPC handle; cuMem POSIX fd over a Unix socket).
epf_add_test(NAME cuda_region_test LABEL gpu SOURCES cuda_region_test.cc cuda_region_test_kernels.cu
             LIBS epfabric_daemon epfabric_client_memory epfabric_common CUDA::cudart_static absl::strings absl::str_format)
target_include_directories(cuda_region_test PRIVATE ${PROJECT_SOURCE_DIR}/daemon)
# CMake 3.25 does not know the flags for CUDA20 with nvcc 13; the test kernels need no more than C++17.
set_target_properties(cuda_region_test PROPERTIES CUDA_STANDARD 17 CUDA_EXTENSIONS OFF)
