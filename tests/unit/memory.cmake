# Region memory: fd passing over Unix sockets, host (POSIX shm) regions and their import by another process.
epf_add_test(NAME fd_passing_test LABEL unit SOURCES fd_passing_test.cc LIBS epfabric_common)
epf_add_test(NAME host_region_test LABEL unit SOURCES host_region_test.cc
             LIBS epfabric_daemon epfabric_client_memory epfabric_common)
target_include_directories(host_region_test PRIVATE ${PROJECT_SOURCE_DIR}/daemon)
epf_add_test(NAME region_without_gpu_test LABEL unit SOURCES region_without_gpu_test.cc
             LIBS epfabric_daemon epfabric_client_memory CUDA::cudart_static)
target_include_directories(region_without_gpu_test PRIVATE ${PROJECT_SOURCE_DIR}/daemon)
