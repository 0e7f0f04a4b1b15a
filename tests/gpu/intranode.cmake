# GPU tests of the intranode kernels against the host reference (1 and 2 GPUs in one process).
epf_add_test(NAME intranode_gpu_test LABEL gpu SOURCES intranode_gpu_test.cc
             LIBS epf_kernel_harness epfabric_kernels)
target_include_directories(intranode_gpu_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/host)
