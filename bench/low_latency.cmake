# Low-latency dispatch/combine benchmark (2 ranks in one process, one GPU each).
add_executable(low_latency_bench low_latency_bench.cc launch_probe.cu)
target_link_libraries(low_latency_bench PRIVATE epf_kernel_harness epfabric_kernels epfabric_bench_report)
target_include_directories(low_latency_bench PRIVATE ${PROJECT_SOURCE_DIR}/kernels/host)
