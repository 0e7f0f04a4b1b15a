// Numeric helpers of the host backend (internal: public only so that host_backend_test can check them bit for bit):
// inline BF16 conversions (bit-identical to reference::FloatToBf16 / host::FloatToBf16 and the kernels'
// __float2bfloat16_rn) and the row loops of the reductions, written so that the compiler vectorises them without
// changing a single rounding: every element is computed by the same float operations, in the same order, as in the
// references (no reassociation, no contraction of a*b+c except where the reference itself uses fmaf).
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

// float -> e4m3 bits, bit-identical to host::FloatToFp8E4M3 (saturating, round to nearest even), with integer
// operations on the float's bits instead of frexp/nearbyint in double (about 10x faster; the tests compare the two
// on 17 million inputs and every rounding tie).
inline uint8_t FloatToFp8E4M3Fast(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7F;   // NaN
  if (abs_bits >= 0x43e00000u) return sign | 0x7E;  // >= 448 (and infinity): saturate
  if (abs_bits < 0x3c800000u) {                     // < 2^-6: multiples of 2^-9, round to nearest even
    float a;
    std::memcpy(&a, &abs_bits, sizeof(a));
    // a * 512 < 8 is exact; adding and subtracting 2^23 rounds it to an integer in the default (nearest-even) mode.
    const float steps = (a * 512.0f + 8388608.0f) - 8388608.0f;
    return sign | static_cast<uint8_t>(steps);
  }
  int exponent = static_cast<int>(abs_bits >> 23) - 127;
  uint32_t mantissa = (abs_bits >> 20) & 7u;
  const uint32_t rest = abs_bits & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (mantissa & 1u) != 0)) ++mantissa;
  if (mantissa == 8) {
    mantissa = 0;
    ++exponent;
  }
  if (exponent > 8 || (exponent == 8 && mantissa > 6)) return sign | 0x7E;  // rounded past 448: saturate
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | mantissa);
}

// host::QuantizeRowFp8 with FloatToFp8E4M3Fast: the same scales and bytes.
void QuantizeRowFp8Fast(const uint16_t* bf16_row, int hidden, bool round_scale, uint8_t* fp8_out, float* scales_out);

}  // namespace epfabric::kernels::host_backend::internal
