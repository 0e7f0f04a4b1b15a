# GPU tests of the intranode kernels against the host reference (1, 2 and 4 ranks in one process; ranks share GPUs
# when there are fewer GPUs than ranks).
epf_add_test(NAME intranode_gpu_test LABEL gpu SOURCES intranode_gpu_test.cc
             LIBS epf_kernel_harness epfabric_kernels epfabric_kernels_reference)
