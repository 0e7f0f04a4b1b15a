# Internode normal-mode benchmark (issue #12): 4 epfabricd as 2 hosts x 2 ranks on the socket wire, epfabric_worker
# per rank. A build target only (no ctest).
add_executable(internode_bench internode_bench.cc)
target_link_libraries(internode_bench PRIVATE epf_integration_support epfabric_bench_report absl::strings absl::time)
target_compile_definitions(internode_bench PRIVATE EPF_WORKER_BINARY="$<TARGET_FILE:epfabric_worker>")
add_dependencies(internode_bench epfabric_worker epfabricd)
