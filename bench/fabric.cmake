# Control-plane benchmark: fabric formation of 8/32/64 daemons and CreateGroup latency (host backend, loopback).
add_executable(fabric_bench fabric_bench.cc)
target_link_libraries(fabric_bench PRIVATE epf_integration_support epfabric_bench_report)
