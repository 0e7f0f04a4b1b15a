// Exact host emulation of the numeric formats the low-latency kernels produce: FP8 e4m3 (saturating,
// round-to-nearest-even, as __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)), BF16 (round-to-nearest-even), and
// the per-128-channel scale computation done by the dispatch kernel, operation for operation, so that the host
// reference is bit-exact against the GPU.
#pragma once

#include <cstdint>

namespace epfabric::kernels::host {

// The largest finite e4m3 value and the constants the kernel uses (float literals, the same on both sides).
inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E4M3MaxInv = 1.0f / 448.0f;
// A group whose largest magnitude is below this is scaled as if it were this (avoids a zero scale), as DeepEP does.
inline constexpr float kFp8MinAmax = 1e-4f;

// float -> e4m3 bits: round to nearest even, finite values beyond +-448 (and infinities) saturate to +-448,
// NaN -> 0x7F (sign kept).
uint8_t FloatToFp8E4M3(float value);
float Fp8E4M3ToFloat(uint8_t bits);

// float -> bf16 bits, round to nearest even (NaN stays NaN).
uint16_t FloatToBf16(float value);
float Bf16ToFloat(uint16_t bits);

// The quantisation of one 128-channel group: the stored scale (dequantised = fp8 * stored_scale) and the
// multiplier applied before the conversion to FP8.
struct Fp8GroupScale {
  float stored_scale = 0;
  float quant_multiplier = 0;
};

// From the group's largest magnitude `amax`: amax is clamped to kFp8MinAmax; without round_scale the stored scale
// is amax * (1/448) and the multiplier 448 / amax; with round_scale the stored scale is 2^ceil(log2(amax * (1/448)))
// and the multiplier its exact inverse.
Fp8GroupScale ComputeFp8GroupScale(float amax, bool round_scale);

// The UE8M0 byte of a power-of-two scale: its biased float exponent.
uint8_t Ue8m0FromScale(float power_of_two_scale);

// Quantises one token row of `hidden` BF16 values (hidden a multiple of 128) into `fp8_out[hidden]` and
// `scales_out[hidden / 128]` exactly as the dispatch kernel does.
void QuantizeRowFp8(const uint16_t* bf16_row, int hidden, bool round_scale, uint8_t* fp8_out, float* scales_out);

}  // namespace epfabric::kernels::host
