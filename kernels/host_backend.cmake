# Host backend: the intranode and low-latency data paths in C++ over shared-memory regions (same layouts and
# protocol as the CUDA kernels). Plain C++, part of epfabric_kernels so that a client can switch backends per call.
set(EPF_HOST_BACKEND_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/host/host_intranode.cc
  ${CMAKE_CURRENT_LIST_DIR}/host/host_low_latency.cc
  ${CMAKE_CURRENT_LIST_DIR}/host/host_numeric.cc)
target_sources(epfabric_kernels PRIVATE ${EPF_HOST_BACKEND_SOURCES})
# -O3 lets GCC vectorise the row loops (element-wise, so no rounding changes; no -ffast-math).
set_source_files_properties(${EPF_HOST_BACKEND_SOURCES} PROPERTIES COMPILE_OPTIONS "-O3")
