// Private numeric helpers of the host backend: inline BF16 conversions (bit-identical to reference::FloatToBf16 /
// host::FloatToBf16 and the kernels' __float2bfloat16_rn) and the row loops of the reductions, written so that the
// compiler vectorises them without changing a single rounding: every element is computed by the same float
// operations, in the same order, as in the references (no reassociation, no contraction of a*b+c except where the
// reference itself uses fmaf).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace epfabric::kernels::host_backend::internal {

inline float Bf16BitsToFloat(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// acc[i] += bf16(row[i]), i < n.
inline void AddBf16Row(float* __restrict acc, const uint16_t* __restrict row, int n) {
  for (int i = 0; i < n; ++i) acc[i] += Bf16BitsToFloat(row[i]);
}

// out[i] = bf16(acc[i]).
inline void StoreBf16Row(uint16_t* __restrict out, const float* __restrict acc, int n) {
  for (int i = 0; i < n; ++i) out[i] = FloatToBf16Bits(acc[i]);
}

// acc[i] = fmaf(bf16(row[i]), w, acc[i]): a fused multiply-add is exactly rounded, so the FMA-instruction version and
// the libm version give the same bits; the first is chosen at run time where the CPU has it (libm's fmaf is a call
// per element).
void FmaBf16Row(float* __restrict acc, const uint16_t* __restrict row, float w, int n);

}  // namespace epfabric::kernels::host_backend::internal
