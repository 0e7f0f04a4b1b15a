# Low-latency kernels with 1, 2 and 4 ranks against the host reference (ranks share GPUs when there are fewer; label
# gpu: skipped without devices).
epf_add_test(NAME low_latency_gpu_test LABEL gpu SOURCES low_latency_gpu_test.cc
             LIBS epf_kernel_harness epfabric_kernels epfabric_kernels_reference)
