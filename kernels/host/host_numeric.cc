#include "host_numeric.h"

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

void FmaBf16Row(float* __restrict acc, const uint16_t* __restrict row, float w, int n) {
  static const FmaRowFn fn = SelectFmaRow();
  fn(acc, row, w, n);
}

}  // namespace epfabric::kernels::host_backend::internal
