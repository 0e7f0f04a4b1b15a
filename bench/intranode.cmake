# Intranode dispatch/combine benchmark (2 ranks, or --num_ranks; ranks share GPUs when there are fewer): prints a
# table and writes JSON to --out (default bench/results).
add_executable(intranode_bench intranode_bench.cc intranode_gate.cu)
target_link_libraries(intranode_bench PRIVATE epf_kernel_harness epfabric_kernels epfabric_kernels_reference
                                              epfabric_kernels_device epfabric_bench_report)
