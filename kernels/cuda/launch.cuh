// The one place where kernels are launched: grid shape, dynamic shared memory (with the opt-in attribute: the
// default 48 KB limit counts static shared memory too) and cooperative launch, for both the intranode and the
// low-latency kernels. Compile-time attributes (__cluster_dims__, __launch_bounds__) stay on the kernels themselves.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace epfabric::kernels {

struct LaunchShape {
  int blocks = 1;
  int threads = 1;
  size_t dynamic_smem_bytes = 0;
  // Every block resident at once (cudaLaunchAttributeCooperative): needed when blocks wait for each other's work.
  bool cooperative = false;
};

// Loads `kernel` on the current device now and opts it in to `dynamic_smem_bytes`. CUDA loads kernels lazily by
// default, and a first launch that has to load code waits for the kernels running on the device: a gate kernel, or
// a peer rank's kernel of the same process spinning on a signal, then holds it up (and the peers waiting for this
// rank's kernel) up to that kernel's timeout: barrier timeouts of the first combine when one process drives several
// GPUs. Querying the attributes loads the function.
template <typename Kernel>
cudaError_t preload_kernel(Kernel kernel, size_t dynamic_smem_bytes = 0) {
  cudaFuncAttributes attributes;
  cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);
  if (err == cudaSuccess && dynamic_smem_bytes > 0) {
    err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic_smem_bytes));
  }
  return err;
}

// Launches `kernel(params)` on `stream` with `shape`. Returns the launch error (cudaSuccess when queued).
template <typename Kernel, typename Params>
cudaError_t launch_kernel(Kernel kernel, const Params& params, const LaunchShape& shape, cudaStream_t stream) {
  // The default limit covers static and dynamic shared memory together, so a kernel with static shared memory needs
  // the opt-in below 48 KB of dynamic memory too (a combine with 4 x 12 KB stages failed to launch without it).
  if (shape.dynamic_smem_bytes > 0) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(shape.dynamic_smem_bytes));
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(shape.blocks);
  config.blockDim = dim3(shape.threads);
  config.dynamicSmemBytes = shape.dynamic_smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attrs[1];
  config.numAttrs = 0;
  if (shape.cooperative) {
    attrs[config.numAttrs].id = cudaLaunchAttributeCooperative;
    attrs[config.numAttrs].val.cooperative = 1;
    ++config.numAttrs;
  }
  config.attrs = config.numAttrs > 0 ? attrs : nullptr;
  return cudaLaunchKernelEx(&config, kernel, params);
}

}  // namespace epfabric::kernels
