# Low-latency dispatch/combine benchmark (2 ranks in one process, or --num_ranks; rank r on GPU r mod n).
add_executable(low_latency_bench low_latency_bench.cc launch_probe.cu)
target_link_libraries(low_latency_bench PRIVATE epf_kernel_harness epfabric_kernels epfabric_kernels_reference
                                                 epfabric_bench_report)
target_include_directories(low_latency_bench PRIVATE ${PROJECT_SOURCE_DIR}/tests)
