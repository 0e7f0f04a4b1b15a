# Low-latency mode (decoding): NVLink dispatch/combine kernels, their layout and checks, and the exact host
# reference (with FP8 emulation) that the GPU tests compare against.
target_sources(epfabric_kernels PRIVATE host/low_latency_layout.cc host/fp8.cc host/low_latency_reference.cc
                                        cuda/low_latency_dispatch.cu cuda/low_latency_combine.cu)

