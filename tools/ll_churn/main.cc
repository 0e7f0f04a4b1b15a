// epfabric_ll_churn: one rank of a low-latency group, run as a fresh client process, that makes its rounds back to
// back (no host work between a dispatch, its combine and the next round) and checks every element afterwards.
// What a serving process does, and what a time-sliced GPU shared by several ranks' processes stresses hardest: the
// ranks' rounds overlap, and each run's first round meets regions that the previous run's clients wrote into.
//
// Every rank derives every rank's inputs from --seed, so it computes the single-process reference itself (after the
// rounds, so that its first round starts right after Attach, as a serving process's does): BF16
// dispatch, experts that return their rows unchanged (combine's input is the dispatch's output tensor, on the device,
// so nothing runs on the host between the calls), combine with the top-k weights. Compared bit for bit: the received
// counts, every received row, every combined element.
//
// Output: `EPF_CHURN rank=R ok=1|0 wrong=N error="..."`; exit 0 (exact), 1 (wrong data), 2 (a call failed).
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"
#include "epfabric/kernels/reference/fp8.h"
#include "epfabric/kernels/reference/low_latency_reference.h"

ABSL_FLAG(std::string, socket, "", "Unix socket of this rank's daemon.");
ABSL_FLAG(std::string, group, "", "Group name (a low-latency group).");
ABSL_FLAG(int, rank, -1, "Group rank to attach as.");
ABSL_FLAG(std::string, token, "", "The group's token.");
ABSL_FLAG(int, rounds, 4, "Rounds of dispatch + combine, back to back.");
ABSL_FLAG(int, tokens, 128, "Tokens per rank per round (BufferConfig.max_tokens_per_rank).");
ABSL_FLAG(int, hidden, 7168, "Hidden size.");
ABSL_FLAG(int, topk, 8, "Top-k.");
ABSL_FLAG(int, experts, 288, "Experts (a multiple of the number of ranks).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of every rank's inputs (the same on every rank of a run).");
ABSL_FLAG(int, timeout_ms, 10000, "BufferConfig.timeout.");
ABSL_FLAG(bool, hooks, false, "Odd rounds go through the receive hooks.");
ABSL_FLAG(int, device, 0, "CUDA device (cuda groups).");

namespace epfabric::churn {
namespace {

namespace host = ::epfabric::kernels::host;
using client::Buffer;
using client::TensorView;
using kernels::DType;

struct Round {
  std::vector<host::LowLatencyRankInput> inputs;
  std::vector<host::LowLatencyDispatchOutput> dispatched;
  std::vector<std::vector<uint16_t>> combined;
};

// Every rank's inputs of one round (the same on every rank for the same seed).
Round MakeInputs(const host::LowLatencyShape& shape, uint64_t seed, int round) {
  std::mt19937_64 rng(seed * 1000003 + round);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f), weight(0.0f, 1.0f);
  Round x;
  x.inputs.resize(shape.num_ranks);
  for (host::LowLatencyRankInput& in : x.inputs) {
    in.num_tokens = shape.max_tokens_per_rank;
    in.x.resize(static_cast<size_t>(in.num_tokens) * shape.hidden);
    for (uint16_t& v : in.x) v = host::FloatToBf16(value(rng));
    in.topk_idx.resize(static_cast<size_t>(in.num_tokens) * shape.num_topk);
    for (int t = 0; t < in.num_tokens; ++t) {
      // Distinct experts per token, a few slots empty (-1).
      std::vector<int64_t> row;
      while (static_cast<int>(row.size()) < shape.num_topk) {
        const int64_t e = static_cast<int64_t>(rng() % shape.num_experts);
        if (std::find(row.begin(), row.end(), e) == row.end()) row.push_back(e);
      }
      if (rng() % 8 == 0) row[rng() % row.size()] = -1;
      std::copy(row.begin(), row.end(), in.topk_idx.begin() + static_cast<ptrdiff_t>(t) * shape.num_topk);
    }
    in.topk_weights.resize(in.topk_idx.size());
    for (float& w : in.topk_weights) w = weight(rng);
  }
  return x;
}

// The single-process reference of a round's inputs: dispatch, experts that return their rows, combine.
void Expect(const host::LowLatencyShape& shape, Round& x) {
  x.dispatched = host::LowLatencyDispatchReference(shape, {.use_fp8 = false}, x.inputs);
  std::vector<std::vector<uint16_t>> experts(shape.num_ranks);
  for (int r = 0; r < shape.num_ranks; ++r) {
    const std::vector<uint8_t>& bytes = x.dispatched[r].packed_recv_x;
    experts[r].resize(bytes.size() / 2);
    std::memcpy(experts[r].data(), bytes.data(), bytes.size());
  }
  x.combined = host::LowLatencyCombineReference(shape, x.inputs, experts, x.dispatched);
}

// Host or device memory, as the group's backend needs.
class Memory {
 public:
  explicit Memory(bool device) : device_(device) {}
  ~Memory() {
    for (void* p : owned_) device_ ? (void)cudaFree(p) : std::free(p);
  }
  absl::StatusOr<TensorView> Upload(const void* src, size_t bytes, DType dtype, std::vector<int64_t> shape) {
    void* p = nullptr;
    if (device_) {
      if (cudaMalloc(&p, std::max<size_t>(bytes, 256)) != cudaSuccess)
        return absl::ResourceExhaustedError("cudaMalloc");
      if (bytes > 0 && cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        return absl::InternalError("cudaMemcpy to the device");
      }
    } else {
      p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
      if (bytes > 0) std::memcpy(p, src, bytes);
    }
    owned_.push_back(p);
    return TensorView{.data = p, .dtype = dtype, .shape = std::move(shape)};
  }
  template <typename T>
  std::vector<T> Download(const TensorView& v, size_t count) const {
    std::vector<T> out(count);
    if (count == 0) return out;
    if (device_) {
      (void)cudaMemcpy(out.data(), v.data, count * sizeof(T), cudaMemcpyDeviceToHost);
    } else {
      std::memcpy(out.data(), v.data, count * sizeof(T));
    }
    return out;
  }

 private:
  bool device_;
  std::vector<void*> owned_;
};

struct Outputs {
  client::LowLatencyDispatchResult recv;
  client::LowLatencyCombineResult combined;
};

int Main() {
  const int rank = absl::GetFlag(FLAGS_rank);
  const std::string prefix = absl::StrCat("EPF_CHURN rank=", rank);
  // Milliseconds since start at each phase, printed with the result: where a run's time goes.
  const absl::Time started = absl::Now();
  std::string phases;
  auto mark = [&](const char* phase) {
    absl::StrAppend(&phases, " ", phase, "_ms=", absl::ToInt64Milliseconds(absl::Now() - started));
  };
  auto fail = [&](const std::string& what, const absl::Status& status) {
    std::cout << prefix << " ok=0 wrong=0" << phases << " error=\"" << what << ": " << status.ToString() << "\""
              << std::endl;
    return 2;
  };
  auto connected = client::Client::Connect(absl::GetFlag(FLAGS_socket), {.client_name = absl::StrCat("churn-", rank)});
  if (!connected.ok()) return fail("Connect", connected.status());
  client::AttachOptions options;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    if (cudaSetDevice(absl::GetFlag(FLAGS_device)) != cudaSuccess) {
      return fail("cudaSetDevice", absl::InvalidArgumentError("--device"));
    }
    options.accessing_device = absl::GetFlag(FLAGS_device);
    (void)cudaFree(nullptr);  // the context now, so that its cost shows as its own phase
  }
  mark("cuda");
  auto lease = (*connected)->Attach(absl::GetFlag(FLAGS_group), rank, absl::GetFlag(FLAGS_token), options);
  // The previous client of this rank may still be leaving (its daemon ends that lease when it sees it go).
  for (int tries = 0; tries < 333 && absl::IsFailedPrecondition(lease.status()); ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    lease = (*connected)->Attach(absl::GetFlag(FLAGS_group), rank, absl::GetFlag(FLAGS_token), options);
  }
  if (!lease.ok()) return fail("Attach", lease.status());
  mark("attached");
  const int R = (*lease)->world_size();
  const host::LowLatencyShape shape{.num_ranks = R,
                                    .num_experts = absl::GetFlag(FLAGS_experts),
                                    .hidden = absl::GetFlag(FLAGS_hidden),
                                    .max_tokens_per_rank = absl::GetFlag(FLAGS_tokens),
                                    .num_topk = absl::GetFlag(FLAGS_topk)};
  client::BufferConfig config{.max_tokens_per_rank = shape.max_tokens_per_rank,
                              .hidden = shape.hidden,
                              .max_topk = shape.num_topk,
                              .num_experts = shape.num_experts,
                              .low_latency = true,
                              .timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms))};
  auto buffer = Buffer::Create(lease->get(), config);
  if (!buffer.ok()) return fail("Buffer::Create", buffer.status());
  Memory mem((*buffer)->backend() == client::Backend::kCuda);

  // Every round's inputs first, so that the rounds run back to back; the references after them, so that the first
  // round starts as soon as the client is attached (as a serving process's does).
  const int rounds = absl::GetFlag(FLAGS_rounds);
  std::vector<Round> expected;
  struct Views {
    TensorView x, idx, w;
  };
  std::vector<Views> views;
  for (int round = 0; round < rounds; ++round) {
    expected.push_back(MakeInputs(shape, absl::GetFlag(FLAGS_seed), round));
    const host::LowLatencyRankInput& in = expected.back().inputs[rank];
    const int64_t T = in.num_tokens, K = shape.num_topk;
    auto x = mem.Upload(in.x.data(), in.x.size() * 2, DType::kBF16, {T, shape.hidden});
    auto idx = mem.Upload(in.topk_idx.data(), in.topk_idx.size() * 8, DType::kInt64, {T, K});
    auto w = mem.Upload(in.topk_weights.data(), in.topk_weights.size() * 4, DType::kFloat32, {T, K});
    for (const auto* v : {&x, &idx, &w}) {
      if (!v->ok()) return fail("upload", v->status());
    }
    views.push_back({*x, *idx, *w});
  }

  mark("uploaded");
  std::vector<Outputs> outputs(rounds);
  for (int round = 0; round < rounds; ++round) {
    const bool hook = absl::GetFlag(FLAGS_hooks) && round % 2 == 1;
    auto recv = (*buffer)->LowLatencyDispatch(
        {.x = views[round].x, .topk_idx = views[round].idx, .use_fp8 = false, .return_recv_hook = hook});
    if (!recv.ok()) return fail(absl::StrCat("round ", round, " dispatch"), recv.status());
    if (hook) {
      if (absl::Status s = recv->recv_hook(nullptr); !s.ok()) return fail(absl::StrCat("round ", round, " hook"), s);
    }
    auto combined = (*buffer)->LowLatencyCombine({.x = recv->packed_recv_x.view,
                                                  .topk_idx = views[round].idx,
                                                  .topk_weights = views[round].w,
                                                  .handle = recv->handle,
                                                  .return_recv_hook = hook});
    if (!combined.ok()) return fail(absl::StrCat("round ", round, " combine"), combined.status());
    if (hook) {
      if (absl::Status s = combined->recv_hook(nullptr); !s.ok()) {
        return fail(absl::StrCat("round ", round, " combine hook"), s);
      }
    }
    outputs[round] = {std::move(*recv), std::move(*combined)};
  }
  if (absl::Status done = (*buffer)->Check(); !done.ok()) return fail("Check", done);
  mark("called");

  // Every element: counts, the received rows of every expert, the combined rows.
  int64_t wrong = 0;
  std::string first;
  auto note = [&](const std::string& what) {
    if (wrong++ == 0) first = what;
  };
  const int L = shape.num_local_experts(), H = shape.hidden;
  const size_t slots = shape.recv_slots();
  for (int round = 0; round < rounds; ++round) {
    // One round's reference at a time: every rank's dispatch outputs are R * L * R*M rows (8 ranks of 7168: 4 GB).
    Expect(shape, expected[round]);
    const host::LowLatencyDispatchOutput& want = expected[round].dispatched[rank];
    const std::vector<int32_t> count = mem.Download<int32_t>(outputs[round].recv.packed_recv_count.view, L);
    const std::vector<uint16_t> got_x =
        mem.Download<uint16_t>(outputs[round].recv.packed_recv_x.view, static_cast<size_t>(L) * slots * H);
    for (int l = 0; l < L; ++l) {
      if (count[l] != want.packed_recv_count[l]) {
        note(
            absl::StrCat("round ", round, " packed_recv_count[", l, "] ", count[l], " != ", want.packed_recv_count[l]));
        continue;
      }
      const size_t n = static_cast<size_t>(count[l]) * H, at = static_cast<size_t>(l) * slots * H;
      for (size_t i = 0; i < n; ++i) {
        uint16_t w;
        std::memcpy(&w, want.packed_recv_x.data() + 2 * (at + i), 2);
        if (got_x[at + i] != w) note(absl::StrCat("round ", round, " packed_recv_x[", l, "] element ", i));
      }
    }
    const std::vector<uint16_t>& want_c = expected[round].combined[rank];
    const std::vector<uint16_t> got_c = mem.Download<uint16_t>(outputs[round].combined.combined_x.view, want_c.size());
    for (size_t i = 0; i < want_c.size(); ++i) {
      if (got_c[i] != want_c[i]) {
        note(absl::StrCat("round ", round, " combined[", i / H, "][", i % H, "] ", host::Bf16ToFloat(got_c[i]),
                          " != ", host::Bf16ToFloat(want_c[i])));
      }
    }
    expected[round] = Round{};
  }
  mark("checked");
  std::cout << prefix << " ok=" << (wrong == 0 ? 1 : 0) << " wrong=" << wrong << phases;
  if (wrong > 0) std::cout << " error=\"" << first << "\"";
  std::cout << std::endl;
  return wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace epfabric::churn

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return epfabric::churn::Main();
}
