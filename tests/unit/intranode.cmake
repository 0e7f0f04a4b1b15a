# Host-only tests of the intranode reference, the region layout and input validation (run in CI, no GPU).
epf_add_test(NAME intranode_reference_test LABEL unit SOURCES intranode_reference_test.cc LIBS epfabric_kernels)
target_include_directories(intranode_reference_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/host)
