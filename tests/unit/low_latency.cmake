# Host tests of the low-latency mode: FP8/BF16 emulation, layout and argument checks, the host reference.
epf_add_test(NAME fp8_test LABEL unit SOURCES fp8_test.cc LIBS epfabric_kernels)
target_link_libraries(fp8_test PRIVATE epfabric_kernels_reference)
epf_add_test(NAME low_latency_reference_test LABEL unit SOURCES low_latency_reference_test.cc LIBS epfabric_kernels)
target_link_libraries(low_latency_reference_test PRIVATE epfabric_kernels_reference)
