# Low-latency mode (decoding): NVLink dispatch/combine kernels, their layout and checks, and the exact host
# reference (with FP8 emulation) that the GPU tests compare against.
target_sources(epfabric_kernels PRIVATE host/low_latency_layout.cc host/fp8.cc host/low_latency_reference.cc
                                        cuda/low_latency_dispatch.cu cuda/low_latency_combine.cu)

# CMake 3.25 does not know nvcc's C++20 flag (it knows up to CUDA17); nvcc 13 accepts -std=c++20. Tell CMake, in
# this directory only, unless a newer CMake (or another fragment) already did.
if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION OR CMAKE_CUDA20_STANDARD_COMPILE_OPTION STREQUAL "")
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
