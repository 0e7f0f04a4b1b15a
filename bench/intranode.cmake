# Intranode dispatch/combine benchmark (2 GPUs): prints a table and writes JSON to --out (default bench/results).
add_executable(intranode_bench intranode_bench.cc intranode_gate.cu)
target_include_directories(intranode_bench PRIVATE ${PROJECT_SOURCE_DIR}/kernels/host ${PROJECT_SOURCE_DIR}/kernels/cuda)
target_link_libraries(intranode_bench PRIVATE epf_kernel_harness epfabric_kernels epfabric_bench_report)
