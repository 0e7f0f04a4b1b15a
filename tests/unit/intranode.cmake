# Host-only tests of the intranode reference, the region layout and input validation (run in CI, no GPU).
epf_add_test(NAME intranode_reference_test LABEL unit SOURCES intranode_reference_test.cc LIBS epfabric_kernels)
target_link_libraries(intranode_reference_test PRIVATE epfabric_kernels_reference)
