# Transport benchmark (issue #11): pickup latency, socket-wire put bandwidth, signal round trip and the daemons' CPU
# use, over 2 epfabricd acting as separate hosts and epfabric_transport_worker --scenario=bench. A build target only
# (no ctest): `transport_bench --quick` runs on the host backend in well under a minute.
add_executable(transport_bench transport_bench.cc)
target_link_libraries(transport_bench PRIVATE epf_integration_support epfabric_bench_report absl::strings absl::time)
target_compile_definitions(transport_bench
                           PRIVATE EPF_TRANSPORT_WORKER_BINARY="$<TARGET_FILE:epfabric_transport_worker>")
add_dependencies(transport_bench epfabric_transport_worker epfabricd)
