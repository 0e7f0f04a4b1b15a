// FP8 e4m3 / BF16 emulation and the per-group scale computation, against values worked out by hand.
#include "epfabric/kernels/reference/fp8.h"

#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

namespace epfabric::kernels::host {
namespace {

TEST(Fp8E4M3, ExactValues) {
  EXPECT_EQ(FloatToFp8E4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(1.0f), 0x38);          // exponent 0 + bias 7
  EXPECT_EQ(FloatToFp8E4M3(-2.0f), 0xC0);         // sign, exponent 1 + 7
  EXPECT_EQ(FloatToFp8E4M3(240.0f), 0x77);        // 1.875 * 2^7
  EXPECT_EQ(FloatToFp8E4M3(448.0f), 0x7E);        // the largest finite value
  EXPECT_EQ(FloatToFp8E4M3(0.015625f), 0x08);     // 2^-6, the smallest normal
  EXPECT_EQ(FloatToFp8E4M3(0.001953125f), 0x01);  // 2^-9, the smallest subnormal
}

TEST(Fp8E4M3, RoundsToNearestEven) {
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);        // halfway between 1.0 (m=0) and 1.125 (m=1): even m=0
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3A);        // halfway between 1.125 (m=1) and 1.25 (m=2): even m=2
  EXPECT_EQ(FloatToFp8E4M3(1.07f), 0x39);          // nearer 1.125
  EXPECT_EQ(FloatToFp8E4M3(0.0009765625f), 0x00);  // 2^-10: half a subnormal step, ties to 0
  EXPECT_EQ(FloatToFp8E4M3(0.0029296875f), 0x02);  // 1.5 steps: ties to 2
  EXPECT_EQ(FloatToFp8E4M3(0.0146484375f), 0x08);  // halfway between 7 * 2^-9 and 2^-6: even (8 steps)
  EXPECT_EQ(FloatToFp8E4M3(400.0f), 0x7C);         // 1.5625 * 2^8 halfway between 384 (m=4) and 416 (m=5): even m=4
}

TEST(Fp8E4M3, SaturatesInsteadOfOverflowing) {
  EXPECT_EQ(FloatToFp8E4M3(449.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(464.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(1e9f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(-1e9f), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(std::nanf("")), 0x7F);
}

TEST(Fp8E4M3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;  // NaN
    const float v = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    EXPECT_EQ(FloatToFp8E4M3(v), code) << "code " << code << " value " << v;
  }
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0.001953125f);
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3F80);  // 1 + 2^-8: halfway, even
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3F82);  // 1 + 3 * 2^-8: halfway, even
  EXPECT_EQ(FloatToBf16(1.005f), 0x3F81);
  EXPECT_EQ(Bf16ToFloat(0x3F81), 1.0078125f);
}

TEST(Fp8Scale, RoundScaleIsTheNextPowerOfTwo) {
  // 100 / 448 = 0.223: ceil(log2) = -2.
  const Fp8GroupScale s = ComputeFp8GroupScale(100.0f, true);
  EXPECT_EQ(s.stored_scale, 0.25f);
  EXPECT_EQ(s.quant_multiplier, 4.0f);
  EXPECT_EQ(Ue8m0FromScale(s.stored_scale), 125);
}

TEST(Fp8Scale, ZeroGroupUsesTheMinimumAmax) {
  // 1e-4 / 448 = 2.23e-7: ceil(log2) = -22.
  const Fp8GroupScale s = ComputeFp8GroupScale(0.0f, true);
  EXPECT_EQ(s.stored_scale, std::ldexp(1.0f, -22));
  EXPECT_EQ(Ue8m0FromScale(s.stored_scale), 105);
  const Fp8GroupScale plain = ComputeFp8GroupScale(0.0f, false);
  EXPECT_EQ(plain.stored_scale, 1e-4f * (1.0f / 448.0f));
}

TEST(Fp8Scale, PlainScaleMapsAmaxTo448) {
  const Fp8GroupScale s = ComputeFp8GroupScale(100.0f, false);
  EXPECT_FLOAT_EQ(s.stored_scale, 100.0f / 448.0f);
  EXPECT_FLOAT_EQ(s.quant_multiplier, 4.48f);
  EXPECT_EQ(FloatToFp8E4M3(100.0f * s.quant_multiplier), 0x7E);
}

TEST(QuantizeRow, HandWorkedGroup) {
  // Group 0: one value 200, the rest 1.0: amax 200, round_scale: 200/448 = 0.446 -> scale 0.5, multiplier 2:
  // 200 * 2 = 400 -> 0x7C (384 after rounding to even), 1.0 * 2 = 2 -> 0x40. Group 1: all -3.0: amax 3 ->
  // 3/448 = 0.0067 -> 2^-7, multiplier 128: -384 -> 0xFC.
  std::vector<uint16_t> row(256);
  for (int i = 0; i < 128; ++i) row[i] = FloatToBf16(1.0f);
  row[5] = FloatToBf16(200.0f);
  for (int i = 128; i < 256; ++i) row[i] = FloatToBf16(-3.0f);
  std::vector<uint8_t> q(256);
  float scales[2];
  QuantizeRowFp8(row.data(), 256, true, q.data(), scales);
  EXPECT_EQ(scales[0], 0.5f);
  EXPECT_EQ(scales[1], 0.0078125f);
  EXPECT_EQ(q[5], 0x7C);
  EXPECT_EQ(q[0], 0x40);
  EXPECT_EQ(q[127], 0x40);
  EXPECT_EQ(q[128], 0xFC);
  EXPECT_EQ(q[255], 0xFC);
}

}  // namespace
}  // namespace epfabric::kernels::host
