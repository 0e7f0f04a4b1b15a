// epfabric_worker --bad_input: every call must be refused with InvalidArgument, before anything runs.
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "checks.h"
#include "memory.h"
#include "worker.h"

namespace epfabric::worker {
namespace {

void ExpectRefused(Checks& checks, const std::string& what, const absl::Status& status, int* refused) {
  if (absl::IsInvalidArgument(status)) {
    ++*refused;
    std::cout << "EPF_EVENT rank=" << checks.rank() << " refused case=\"" << what << "\""
              << " status=\"" << absl::StrReplaceAll(status.message(), {{"\"", "'"}, {"\n", " "}}) << "\"\n";
  } else {
    checks.Fail(absl::StrCat("bad input '", what, "' was not refused with InvalidArgument: ", status.ToString()));
  }
}

// Normal mode: refused by GetDispatchLayout, or else by Dispatch.
absl::Status NormalDispatchStatus(Buffer& buffer, const TensorView& x, const TensorView& idx, const TensorView& w) {
  auto layout = buffer.GetDispatchLayout(idx);
  if (!layout.ok()) return layout.status();
  auto recv = buffer.Dispatch({.x = x, .topk_idx = idx, .topk_weights = w, .layout = &*layout});
  return recv.status();
}

}  // namespace

absl::Status RunBadInput(Buffer& buffer, Memory& mem, const Scenario& s, Checks& checks, int* refused, int* cases) {
  const int T = std::max(1, std::min(4, s.tokens)), K = s.topk, H = s.hidden, M = s.tokens;
  mem.Clear();
  const std::vector<uint16_t> x_small(static_cast<size_t>(M + 1) * (H + 128), ref::FloatToBf16(1.0f));
  std::vector<int64_t> idx_ok(static_cast<size_t>(M + 1) * K, -1), idx_bad(static_cast<size_t>(T) * K, -1);
  for (size_t i = 0; i < idx_ok.size(); i += K) idx_ok[i] = static_cast<int64_t>(i / K) % s.experts;
  for (size_t i = 0; i < idx_bad.size(); i += K) idx_bad[i] = i == 0 ? s.experts : 0;  // expert index == num_experts
  const std::vector<float> w(static_cast<size_t>(M + 1) * K, 0.5f);
  auto x = [&](DType dtype, int rows, int hidden) { return mem.Upload(x_small, dtype, {rows, hidden}); };
  auto idx = [&](const std::vector<int64_t>& v, int rows) { return mem.Upload(v, DType::kInt64, {rows, K}); };
  auto weights = [&](int rows) { return mem.Upload(w, DType::kFloat32, {rows, K}); };
  struct Case {
    std::string name;
    absl::StatusOr<TensorView> x, idx, w;
  };
  std::vector<Case> bad;
  bad.push_back({"dtype: float32 x", x(DType::kFloat32, T, H), idx(idx_ok, T), weights(T)});
  bad.push_back({"shape: topk_idx rows != x rows", x(DType::kBF16, T, H), idx(idx_ok, T + 1), weights(T + 1)});
  bad.push_back({"expert index >= num_experts", x(DType::kBF16, T, H), idx(idx_bad, T), weights(T)});
  bad.push_back(
      {"more tokens than max_tokens_per_rank", x(DType::kBF16, M + 1, H), idx(idx_ok, M + 1), weights(M + 1)});
  if (s.low_latency) {
    bad.push_back({"hidden != the buffer's hidden", x(DType::kBF16, T, H + 128), idx(idx_ok, T), weights(T)});
  } else {
    bad.push_back({"unaligned hidden (not a multiple of 8)", x(DType::kBF16, T, 12), idx(idx_ok, T), weights(T)});
    bad.push_back({"hidden wider than the buffer's", x(DType::kBF16, T, H + 128), idx(idx_ok, T), weights(T)});
  }
  for (Case& c : bad) {
    for (const auto* v : {&c.x, &c.idx, &c.w}) {
      if (!v->ok()) return v->status();
    }
    ++*cases;
    if (s.low_latency) {
      ExpectRefused(checks, c.name,
                    buffer.LowLatencyDispatch({.x = *c.x, .topk_idx = *c.idx, .use_fp8 = s.fp8}).status(), refused);
    } else {
      ExpectRefused(checks, c.name, NormalDispatchStatus(buffer, *c.x, *c.idx, *c.w), refused);
    }
  }
  return absl::OkStatus();
}

}  // namespace epfabric::worker
