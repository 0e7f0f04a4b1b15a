# Low-latency kernels on 1 and 2 GPUs against the host reference (label gpu: skipped without devices).
epf_add_test(NAME low_latency_gpu_test LABEL gpu SOURCES low_latency_gpu_test.cc LIBS epfabric_kernels)
target_link_libraries(low_latency_gpu_test PRIVATE epfabric_kernels_reference)
