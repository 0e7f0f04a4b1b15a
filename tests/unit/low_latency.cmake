# Host tests of the low-latency mode: FP8/BF16 emulation, layout and argument checks, the host reference.
epf_add_test(NAME fp8_test LABEL unit SOURCES fp8_test.cc LIBS epfabric_kernels)
target_include_directories(fp8_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/host)
epf_add_test(NAME low_latency_reference_test LABEL unit SOURCES low_latency_reference_test.cc LIBS epfabric_kernels)
target_include_directories(low_latency_reference_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/host)
