# Cuda regions shared with a separate process, both ways (CUDA IPC handle; cuMem POSIX fd over a Unix socket).
epf_add_test(NAME cuda_region_test LABEL gpu SOURCES cuda_region_test.cc cuda_region_test_kernels.cu
             LIBS epfabric_daemon epfabric_client_memory epfabric_common CUDA::cudart_static absl::strings absl::str_format)
target_include_directories(cuda_region_test PRIVATE ${PROJECT_SOURCE_DIR}/daemon)
