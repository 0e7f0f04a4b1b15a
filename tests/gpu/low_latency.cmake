# Low-latency kernels on 1 and 2 GPUs against the host reference (label gpu: skipped without devices).
epf_add_test(NAME low_latency_gpu_test LABEL gpu SOURCES low_latency_gpu_test.cc LIBS epf_kernel_harness epfabric_kernels)
target_include_directories(low_latency_gpu_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/host)
