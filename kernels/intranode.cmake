# CMake 3.25 (the build machines' version) does not know nvcc's C++20 flag, which the project's CUDA_STANDARD 20
# needs as soon as the library has a .cu source; nvcc 13 supports -std=c++20.
if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION OR CMAKE_CUDA20_STANDARD_COMPILE_OPTION STREQUAL "")
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()

# Normal-mode intranode kernels (layout, notify, dispatch, combine) and their host side. One .cu per kernel keeps
# each translation unit quick to compile; the host reference is plain C++ (also used by tests and the host backend).
target_sources(epfabric_kernels PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/cuda/layout.cu
  ${CMAKE_CURRENT_LIST_DIR}/cuda/intranode_notify.cu
  ${CMAKE_CURRENT_LIST_DIR}/cuda/intranode_dispatch.cu
  ${CMAKE_CURRENT_LIST_DIR}/cuda/intranode_combine.cu
  ${CMAKE_CURRENT_LIST_DIR}/host/intranode_api.cc
  ${CMAKE_CURRENT_LIST_DIR}/host/intranode_reference.cc)
