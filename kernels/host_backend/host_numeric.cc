#include "epfabric/kernels/host_backend_numeric.h"

#include <algorithm>

#include "epfabric/kernels/reference/fp8.h"

namespace epfabric::kernels::host_backend::internal {
namespace {

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) void FmaBf16RowAvx2(float* __restrict acc, const uint16_t* __restrict row, float w,
                                                        int n) {
  for (int i = 0; i < n; ++i) acc[i] = __builtin_fmaf(Bf16BitsToFloat(row[i]), w, acc[i]);
}
#endif

void FmaBf16RowPortable(float* __restrict acc, const uint16_t* __restrict row, float w, int n) {
  for (int i = 0; i < n; ++i) acc[i] = std::fmaf(Bf16BitsToFloat(row[i]), w, acc[i]);
}

using FmaRowFn = void (*)(float*, const uint16_t*, float, int);

FmaRowFn SelectFmaRow() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return FmaBf16RowAvx2;
#endif
  return FmaBf16RowPortable;
}

}  // namespace

void QuantizeRowFp8Fast(const uint16_t* bf16_row, int hidden, bool round_scale, uint8_t* fp8_out, float* scales_out) {
  constexpr int kGroup = 128;
  for (int g = 0; g < hidden / kGroup; ++g) {
    const uint16_t* in = bf16_row + g * kGroup;
    float amax = 0.0f;
    for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(Bf16BitsToFloat(in[i])));
    const host::Fp8GroupScale s = host::ComputeFp8GroupScale(amax, round_scale);
    scales_out[g] = s.stored_scale;
    for (int i = 0; i < kGroup; ++i)
      fp8_out[g * kGroup + i] = FloatToFp8E4M3Fast(Bf16BitsToFloat(in[i]) * s.quant_multiplier);
  }
}

void FmaBf16Row(float* __restrict acc, const uint16_t* __restrict row, float w, int n) {
  static const FmaRowFn fn = SelectFmaRow();
  fn(acc, row, w, n);
}

}  // namespace epfabric::kernels::host_backend::internal
