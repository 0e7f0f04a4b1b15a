#include "epfabric/kernels/reference/fp8.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace epfabric::kernels::host {

uint8_t FloatToFp8E4M3(float value) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return sign | 0x7F;
  // Work in double: every step below is exact there except the one rounding we want.
  const double a = std::fabs(static_cast<double>(value));
  if (a >= 448.0) return sign | 0x7E;             // saturate (SATFINITE): 448 = 1.75 * 2^8 is the largest finite value
  constexpr double kMinNormal = 0.015625;         // 2^-6
  constexpr double kSubnormalStep = 0.001953125;  // 2^-9
  if (a < kMinNormal) {
    // Subnormals (and zero): multiples of 2^-9. A result of 8 steps is 2^-6, whose encoding 0x08 follows on.
    const double steps = std::nearbyint(a / kSubnormalStep);  // default rounding mode: to nearest, ties to even
    return sign | static_cast<uint8_t>(steps);
  }
  int exponent = 0;
  const double fraction = std::frexp(a, &exponent);  // a = fraction * 2^exponent, fraction in [0.5, 1)
  int e = exponent - 1;                              // a = m * 2^e with m in [1, 2)
  const double m = fraction * 2.0;
  int mantissa = static_cast<int>(std::nearbyint((m - 1.0) * 8.0));
  if (mantissa == 8) {
    mantissa = 0;
    ++e;
  }
  if (e > 8 || (e == 8 && mantissa > 6)) return sign | 0x7E;  // rounded past 448: saturate
  return sign | static_cast<uint8_t>(((e + 7) << 3) | mantissa);
}

float Fp8E4M3ToFloat(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
}

uint16_t FloatToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  const uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

Fp8GroupScale ComputeFp8GroupScale(float amax, bool round_scale) {
  amax = std::max(amax, kFp8MinAmax);
  Fp8GroupScale s;
  if (round_scale) {
    // ceil(log2(ratio)) from the float's bits: its exponent, plus one unless the mantissa is zero. Exact, and the
    // same integer operations as the kernel.
    const float ratio = amax * kFp8E4M3MaxInv;
    const uint32_t bits = std::bit_cast<uint32_t>(ratio);
    int exponent = static_cast<int>((bits >> 23) & 0xFF) - 127;
    if ((bits & 0x7FFFFF) != 0) ++exponent;
    s.stored_scale = std::bit_cast<float>(static_cast<uint32_t>(exponent + 127) << 23);
    s.quant_multiplier = std::bit_cast<float>(static_cast<uint32_t>(127 - exponent) << 23);
  } else {
    s.stored_scale = amax * kFp8E4M3MaxInv;
    s.quant_multiplier = kFp8E4M3Max / amax;
  }
  return s;
}

uint8_t Ue8m0FromScale(float power_of_two_scale) {
  return static_cast<uint8_t>((std::bit_cast<uint32_t>(power_of_two_scale) >> 23) & 0xFF);
}

void QuantizeRowFp8(const uint16_t* bf16_row, int hidden, bool round_scale, uint8_t* fp8_out, float* scales_out) {
  for (int g = 0; g < hidden / 128; ++g) {
    float amax = 0.0f;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(Bf16ToFloat(bf16_row[g * 128 + i])));
    const Fp8GroupScale s = ComputeFp8GroupScale(amax, round_scale);
    scales_out[g] = s.stored_scale;
    for (int i = 0; i < 128; ++i) {
      fp8_out[g * 128 + i] = FloatToFp8E4M3(Bf16ToFloat(bf16_row[g * 128 + i]) * s.quant_multiplier);
    }
  }
}

}  // namespace epfabric::kernels::host
