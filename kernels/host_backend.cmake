# Host backend: the intranode and low-latency data paths in C++ over shared-memory regions (same layouts and
# protocol as the CUDA kernels). Plain C++, part of epfabric_kernels so that a client can switch backends per call.
target_sources(epfabric_kernels PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/host/host_intranode.cc
  ${CMAKE_CURRENT_LIST_DIR}/host/host_low_latency.cc)
