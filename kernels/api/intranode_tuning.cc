// The intranode kernels' measured settings (copy warps, combine chunks) per GPU kind, and which kind this is.
#include <atomic>

#include <cuda_runtime.h>

#include "api/launch.h"
#include "epfabric/kernels/intranode.h"

namespace epfabric::kernels {
namespace {

// H100 SXM has 3.35 TB/s of HBM3, H200 4.8 TB/s of HBM3e; the rest of what these settings depend on (SMs, NVLink)
// is the same on both.
constexpr double kH200MinMemoryBytesPerSecond = 4.0e12;

TunedGpu Classify(int device) {
  int clock_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return TunedGpu::kH100;
  }
  // Double data rate: two transfers per clock of bus_bits each.
  const double bytes_per_second = 2.0 * clock_khz * 1e3 * bus_bits / 8.0;
  return bytes_per_second >= kH200MinMemoryBytesPerSecond ? TunedGpu::kH200 : TunedGpu::kH100;
}

}  // namespace

TunedGpu CurrentTunedGpu() {
  // Per device ordinal, found once: 0 = not yet, else the TunedGpu value + 1.
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // zero-initialized (static storage)
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    (void)cudaGetLastError();
    return TunedGpu::kH100;
  }
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    value = static_cast<int>(Classify(device)) + 1;
    cache[device].store(value, std::memory_order_relaxed);
  }
  return static_cast<TunedGpu>(value - 1);
}

int IntranodeDispatchCopyWarps(int num_ranks, int row_bytes, int num_sms, TunedGpu gpu) {
  // Measured settings (sweeps on H100 and on H200, docs/intranode-kernels.md "Warp roles" and "Tuned on H200"), not a
  // model. Fewer copy warps mean fewer stores in flight and more receivers; the best count falls as a row goes to more
  // places (more ranks) and as the channels grow, and rises for smaller rows (FP8 rows of 7 KB are more
  // latency-bound). Rows under 4 KB (hidden < 2048 in BF16) were not swept and keep the previous 15; 3 and 8 ranks
  // take the 4-rank settings (swept on H100 only).
  static_assert(15 <= intranode::kMaxCopyWarps);
  constexpr int kSweptRowBytes = 4096;
  constexpr int kLargeRowBytes = 8192;
  if (row_bytes < kSweptRowBytes || num_ranks < 2) return 15;
  const bool large = row_bytes >= kLargeRowBytes;
  if (num_ranks >= 3) {
    if (!large) return 7;
    return num_sms <= 16 ? 9 : num_sms <= 20 ? 5 : num_sms <= 28 ? 4 : 7;
  }
  if (!large) return 15;
  // 2 ranks, BF16 at hidden >= 4096: above 28 channels H200 wants 7 (206 us at 32 SMs; 9 gave 229), H100 took 9
  // (7 was not measured there).
  return num_sms <= 20 ? 15 : num_sms <= 28 ? 11 : gpu == TunedGpu::kH200 ? 7 : 9;
}

int IntranodeCombineChunkBytes(int num_ranks, int num_channels, TunedGpu gpu) {
  // Measured on 2 x H100 and 2 x H200 ("Combine chunks"), not a model: with one store in flight per sender, the
  // chunk size sets the bytes in flight over the links, and the best size moves with the channel count and the GPU,
  // in narrow steps (H200 at 24 SMs: 10 KB 199-203 us, 9.5 or 10.5 KB 204-207, 14 KB 233). 3 or more ranks were not
  // swept and keep 16 KB.
  static_assert(intranode::kMaxCombineChunkBytes >= 24576);
  if (num_ranks != 2) return 16384;
  if (gpu == TunedGpu::kH200) {
    return num_channels <= 16 ? 24576 : num_channels <= 20 ? 14336 : num_channels <= 28 ? 10240 : 24576;
  }
  return num_channels <= 16 ? 20480 : num_channels <= 20 ? 16384 : num_channels <= 28 ? 14336 : 16384;
}

}  // namespace epfabric::kernels
