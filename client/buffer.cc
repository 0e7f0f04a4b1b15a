// The Buffer API over a Lease: validation of every input before anything is launched, output allocation through
// the Allocator, and the calls into the kernels library (CUDA launches on the caller's stream, or the host backend
// on the calling thread). docs/data-layout.md describes every output.
#include "epfabric/client/buffer.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "epfabric/kernels/host_backend.h"

namespace epfabric::client {
namespace {

using kernels::DType;

constexpr size_t kMinAllocationBytes = 256;  // never hand a kernel a null pointer for a given, empty tensor
constexpr int kNumInvalidTopkSlots = 64;     // mapped host words for the layout kernel's invalid-entry count

const char* BoolName(bool value) { return value ? "true" : "false"; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// ---- validation helpers: every message names the field and its value ----

absl::Status ExpectDType(const TensorView& t, const char* name, DType want) {
  if (t.dtype != want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.dtype = %s: expected %s", name, kernels::DTypeName(t.dtype), kernels::DTypeName(want)));
  }
  return absl::OkStatus();
}

// `want` holds the expected sizes (-1: any), `meaning` names the dimensions for the message.
absl::Status ExpectShape(const TensorView& t, const char* name, const std::vector<int64_t>& want, const char* meaning) {
  bool ok = t.shape.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = t.shape[i] >= 0 && (want[i] < 0 || t.shape[i] == want[i]);
  if (!ok) {
    std::vector<std::string> dims;
    for (int64_t d : want) dims.push_back(d < 0 ? std::string("*") : absl::StrCat(d));
    return absl::InvalidArgumentError(absl::StrFormat("%s.shape = %s: expected [%s] (%s)", name, ShapeString(t.shape),
                                                      absl::StrJoin(dims, ", "), meaning));
  }
  if (t.numel() > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s.data is null with shape %s", name, ShapeString(t.shape)));
  }
  return absl::OkStatus();
}

absl::Status ExpectTensor(const TensorView& t, const char* name, DType dtype, const std::vector<int64_t>& shape,
                          const char* meaning) {
  if (absl::Status s = ExpectDType(t, name, dtype); !s.ok()) return s;
  return ExpectShape(t, name, shape, meaning);
}

absl::Status Invalid(const std::string& field, int64_t value, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrFormat("%s = %d: %s", field, value, why));
}

// Host memory only: the first top-k entry outside [-1, num_experts), as an error.
absl::Status CheckExpertIndices(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk, int num_experts,
                                const char* name) {
  for (int64_t i = 0; i < num_tokens * num_topk; ++i) {
    const int64_t e = topk_idx[i];
    if (e < -1 || e >= num_experts) {
      return absl::InvalidArgumentError(absl::StrFormat("%s[%d][%d] = %d: expert indices must be in [-1, %d)", name,
                                                        i / num_topk, i % num_topk, e, num_experts));
    }
  }
  return absl::OkStatus();
}

// A pointer the kernels accept for a given tensor: never null (an empty but given tensor still says "given" to the
// peers). With no elements nothing is read or written through it, so a host address serves on cuda as well; it is
// aligned because the kernels' argument checks want 16-byte alignment.
template <typename T>
T* GivenPointer(const TensorView& t) {
  alignas(256) static uint64_t dummy[32] = {};
  if (t.empty()) return nullptr;
  return static_cast<T*>(t.data != nullptr ? t.data : static_cast<void*>(dummy));
}

// ---- allocators ----

class CudaAsyncAllocator final : public Allocator {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t stream) override {
    void* ptr = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&ptr, bytes, stream));
    return ptr;
  }
  void Free(void* ptr, cudaStream_t stream) override { cudaFreeAsync(ptr, stream); }
};

class HostAllocator final : public Allocator {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t /*stream*/) override {
    const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
    void* ptr = std::aligned_alloc(256, rounded);
    if (ptr == nullptr) return absl::ResourceExhaustedError(absl::StrFormat("host allocation of %d bytes", bytes));
    return ptr;
  }
  void Free(void* ptr, cudaStream_t /*stream*/) override { std::free(ptr); }
};

// Mapped host words for the layout kernel's count of invalid top-k entries, handed out one per DispatchLayout and
// returned when the layout's last copy goes (so a slot is never shared by two live layouts).
class MappedWordPool {
 public:
  static absl::StatusOr<std::shared_ptr<MappedWordPool>> Create() {
    auto pool = std::shared_ptr<MappedWordPool>(new MappedWordPool);
    void* host = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host, kNumInvalidTopkSlots * sizeof(int32_t), cudaHostAllocMapped));
    pool->host_ = static_cast<int32_t*>(host);
    void* device = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device, host, 0));
    pool->device_ = static_cast<int32_t*>(device);
    for (int i = 0; i < kNumInvalidTopkSlots; ++i) pool->free_.push_back(i);
    return pool;
  }
  ~MappedWordPool() {
    if (host_ != nullptr) cudaFreeHost(host_);
  }
  // A slot or -1 when all are taken (the caller then does without). A slot given back while its layout kernel may
  // still be queued (value still -1) is only reused once the kernel has written it, so a late write can never land
  // in the next layout's count.
  int Take() {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < returned_.size();) {
      if (static_cast<volatile int32_t*>(host_)[returned_[i]] >= 0) {
        free_.push_back(returned_[i]);
        returned_[i] = returned_.back();
        returned_.pop_back();
      } else {
        ++i;
      }
    }
    if (free_.empty()) return -1;
    const int slot = free_.back();
    free_.pop_back();
    return slot;
  }
  void Give(int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    returned_.push_back(slot);
  }
  volatile int32_t* host(int slot) { return host_ + slot; }
  int32_t* device(int slot) { return device_ + slot; }

 private:
  MappedWordPool() = default;
  std::mutex mu_;
  std::vector<int> free_;
  std::vector<int> returned_;  // given back, reusable once the kernel wrote them
  int32_t* host_ = nullptr;
  int32_t* device_ = nullptr;
};

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t TensorView::bytes() const { return static_cast<size_t>(numel()) * kernels::DTypeSize(dtype); }

std::shared_ptr<Allocator> DefaultAllocator(v1::Backend backend) {
  if (backend == v1::BACKEND_CUDA) return std::make_shared<CudaAsyncAllocator>();
  return std::make_shared<HostAllocator>();
}

absl::StatusOr<uint64_t> RequiredRegionBytes(const BufferConfig& config, int num_nvl_ranks) {
  if (num_nvl_ranks < 1 || num_nvl_ranks > kernels::kMaxNvlPeers) {
    return Invalid("num_nvl_ranks", num_nvl_ranks, absl::StrCat("must be in [1, ", kernels::kMaxNvlPeers, "]"));
  }
  if (config.max_tokens_per_rank < 1)
    return Invalid("config.max_tokens_per_rank", config.max_tokens_per_rank, "must be >= 1");
  if (config.hidden < 1) return Invalid("config.hidden", config.hidden, "must be >= 1");
  if (config.max_topk < 1) return Invalid("config.max_topk", config.max_topk, "must be >= 1");
  if (config.num_experts < 1 || config.num_experts % num_nvl_ranks != 0) {
    return Invalid("config.num_experts", config.num_experts,
                   absl::StrCat("must be a positive multiple of the number of ranks (", num_nvl_ranks, ")"));
  }
  if (config.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.timeout = ", absl::FormatDuration(config.timeout), ": must be positive"));
  }
  if (config.low_latency) {
    if (config.max_topk > kernels::kLowLatencyMaxTopk) {
      return Invalid("config.max_topk", config.max_topk,
                     absl::StrCat("must be at most ", kernels::kLowLatencyMaxTopk, " in low-latency mode"));
    }
    auto bytes =
        kernels::LowLatencyRegionBytes(config.max_tokens_per_rank, config.hidden, num_nvl_ranks, config.num_experts);
    if (!bytes.ok()) return bytes.status();
    return static_cast<uint64_t>(*bytes);
  }
  if (config.num_sms < 1) return Invalid("config.num_sms", config.num_sms, "must be >= 1");
  kernels::IntranodeRegionConfig region{.num_ranks = num_nvl_ranks,
                                        .max_tokens_per_rank = config.max_tokens_per_rank,
                                        .max_hidden = config.hidden,
                                        .max_topk = config.max_topk,
                                        .num_experts = config.num_experts,
                                        .max_channels = config.num_sms};
  auto bytes = kernels::IntranodeRegionBytes(region);
  if (!bytes.ok()) return bytes.status();
  return static_cast<uint64_t>(*bytes);
}

// ---------------------------------------------------------------------------------------------------------------

struct Buffer::State {
  Lease* lease = nullptr;
  BufferConfig config;
  std::shared_ptr<Allocator> allocator;
  bool cuda = false;
  int rank = 0;
  int num_ranks = 0;
  int experts_per_rank = 0;

  kernels::IntranodeGroup group;  // normal mode
  kernels::LowLatencyContext ll;  // low-latency mode
  kernels::LowLatencyBufferCursor cursor;
  bool recv_hook_pending = false;  // a low-latency send phase whose receive hook has not run yet

  // Status word: device memory (cuda) or host memory (host backend).
  kernels::KernelStatus* status = nullptr;
  kernels::KernelStatus host_status{};
  // Notify's counters: [0] = received tokens, [1..] per local expert. cuda: mapped host memory (host_counters is
  // the host view, device_counters the device view); host backend: plain memory.
  int32_t* host_counters = nullptr;
  int32_t* device_counters = nullptr;
  std::vector<int32_t> host_counter_storage;
  // Low latency: the rank mask (device memory on cuda, host memory on the host backend).
  int32_t* rank_mask = nullptr;
  std::vector<int32_t> host_rank_mask;
  std::shared_ptr<MappedWordPool> invalid_topk_words;  // cuda only

  ~State() {
    if (cuda) {
      if (status != nullptr) cudaFree(status);
      if (rank_mask != nullptr) cudaFree(rank_mask);
      if (host_counters != nullptr) cudaFreeHost(host_counters);
    }
  }

  uint64_t timeout_ns() const { return static_cast<uint64_t>(absl::ToInt64Nanoseconds(config.timeout)); }

  absl::Status Usable() const {
    if (absl::Status healthy = lease->Healthy(); !healthy.ok()) {
      return absl::UnavailableError(absl::StrCat("the group is not usable: ", healthy.message()));
    }
    return absl::OkStatus();
  }

  absl::Status RequireMode(bool low_latency, const char* call) const {
    if (config.low_latency != low_latency) {
      return absl::FailedPreconditionError(absl::StrFormat("%s needs a %s buffer; this one has config.low_latency = %s",
                                                           call, low_latency ? "low-latency" : "normal-mode",
                                                           BoolName(config.low_latency)));
    }
    if (low_latency && recv_hook_pending) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%s: the previous low-latency call's recv_hook has not run (its receive phase must run "
                          "before the next call's send phase)",
                          call));
    }
    return absl::OkStatus();
  }

  // An output tensor from the allocator (at least kMinAllocationBytes, so pointers are never null).
  absl::StatusOr<Tensor> NewTensor(DType dtype, std::vector<int64_t> shape, cudaStream_t stream) {
    Tensor t;
    t.view.dtype = dtype;
    t.view.shape = std::move(shape);
    const size_t bytes = std::max(t.view.bytes(), kMinAllocationBytes);
    auto ptr = allocator->Allocate(bytes, stream);
    if (!ptr.ok()) return ptr.status();
    t.view.data = *ptr;
    std::shared_ptr<Allocator> owner = allocator;
    t.storage = std::shared_ptr<void>(*ptr, [owner, stream](void* p) { owner->Free(p, stream); });
    return t;
  }

  // After a failed or timed-out call on cuda: the kernel's record (naming the peer) explains it better than the
  // host-side error.
  absl::Status KernelStatusOr(absl::Status fallback, cudaStream_t stream) {
    if (!cuda) return fallback;
    absl::Status kernel = kernels::ReadKernelStatus(status, stream);
    if (!kernel.ok()) {
      kernels::ClearKernelStatus(status, stream).IgnoreError();
      return kernel;
    }
    return fallback;
  }
};

Buffer::Buffer(std::unique_ptr<State> state) : state_(std::move(state)) {}
Buffer::~Buffer() = default;

int Buffer::rank() const { return state_->rank; }
int Buffer::num_ranks() const { return state_->num_ranks; }
v1::Backend Buffer::backend() const { return state_->cuda ? v1::BACKEND_CUDA : v1::BACKEND_HOST; }
const BufferConfig& Buffer::config() const { return state_->config; }

absl::StatusOr<std::unique_ptr<Buffer>> Buffer::Create(Lease* lease, BufferConfig config,
                                                       std::shared_ptr<Allocator> allocator) {
  if (lease == nullptr) return absl::InvalidArgumentError("lease is null");
  if (absl::Status healthy = lease->Healthy(); !healthy.ok()) {
    return absl::UnavailableError(absl::StrCat("the group is not usable: ", healthy.message()));
  }
  if (config.low_latency != lease->group().low_latency()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("config.low_latency = %s but group '%s' was created with low_latency = %s",
                        BoolName(config.low_latency), lease->group_name(), BoolName(lease->group().low_latency())));
  }
  const v1::Backend backend = lease->backend();
  if (backend != v1::BACKEND_CUDA && backend != v1::BACKEND_HOST) {
    return absl::InvalidArgumentError(absl::StrCat("lease backend = ", v1::Backend_Name(backend), ": not supported"));
  }
  const int world = lease->world_size();
  const std::vector<int>& nvl = lease->nvl_ranks();
  if (static_cast<int>(nvl.size()) != world) {
    return absl::UnimplementedError(absl::StrFormat(
        "group '%s' has %d ranks of which %d are on this host: only intranode groups (every rank on this host) are "
        "supported by the Buffer so far",
        lease->group_name(), world, nvl.size()));
  }
  if (world > kernels::kMaxNvlPeers) {
    return Invalid("world_size", world, absl::StrCat("at most ", kernels::kMaxNvlPeers, " same-host ranks"));
  }
  auto required = RequiredRegionBytes(config, world);
  if (!required.ok()) return required.status();
  for (int r = 0; r < world; ++r) {
    if (lease->region(r) == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat("region of rank %d is not mapped", r));
    }
    if (lease->region_bytes(r) < *required) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "region of rank %d has %d bytes; config (max_tokens_per_rank %d, hidden %d, max_topk %d, num_experts %d, "
          "num_sms %d, low_latency %s) needs RequiredRegionBytes = %d",
          r, lease->region_bytes(r), config.max_tokens_per_rank, config.hidden, config.max_topk, config.num_experts,
          config.num_sms, BoolName(config.low_latency), *required));
    }
  }

  auto state = std::make_unique<State>();
  state->lease = lease;
  state->config = config;
  state->cuda = backend == v1::BACKEND_CUDA;
  state->allocator = allocator != nullptr ? std::move(allocator) : DefaultAllocator(backend);
  state->rank = lease->rank();
  state->num_ranks = world;
  state->experts_per_rank = config.num_experts / world;

  if (state->cuda) {
    void* status = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaMalloc(&status, sizeof(kernels::KernelStatus)));
    state->status = static_cast<kernels::KernelStatus*>(status);
    EPF_CUDA_RETURN_IF_ERROR(cudaMemset(status, 0, sizeof(kernels::KernelStatus)));
    if (config.low_latency) {
      void* mask = nullptr;
      EPF_CUDA_RETURN_IF_ERROR(cudaMalloc(&mask, sizeof(int32_t) * world));
      state->rank_mask = static_cast<int32_t*>(mask);
      EPF_CUDA_RETURN_IF_ERROR(cudaMemset(mask, 0, sizeof(int32_t) * world));
    } else {
      void* counters = nullptr;
      EPF_CUDA_RETURN_IF_ERROR(
          cudaHostAlloc(&counters, sizeof(int32_t) * (1 + state->experts_per_rank), cudaHostAllocMapped));
      state->host_counters = static_cast<int32_t*>(counters);
      void* device = nullptr;
      EPF_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device, counters, 0));
      state->device_counters = static_cast<int32_t*>(device);
      auto pool = MappedWordPool::Create();
      if (!pool.ok()) return pool.status();
      state->invalid_topk_words = *std::move(pool);
    }
    EPF_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  } else {
    state->status = &state->host_status;
    state->host_counter_storage.assign(1 + state->experts_per_rank, -1);
    state->host_counters = state->device_counters = state->host_counter_storage.data();
    state->host_rank_mask.assign(world, 0);
    if (config.low_latency) state->rank_mask = state->host_rank_mask.data();
  }

  // The regions were zeroed by the daemon when the lease started, so no reset is needed here.
  if (config.low_latency) {
    auto layout = kernels::MakeLowLatencyLayout(config.max_tokens_per_rank, config.hidden, world, config.num_experts);
    if (!layout.ok()) return layout.status();
    kernels::LowLatencyContext& ll = state->ll;
    ll.rank = state->rank;
    ll.num_ranks = world;
    for (int r = 0; r < world; ++r) ll.peer_regions[r] = lease->region(r);
    ll.layout = *layout;
    ll.rank_mask = state->rank_mask;
    ll.status = state->status;
    ll.timeout_ns = state->timeout_ns();
  } else {
    kernels::IntranodeGroup& group = state->group;
    group.config = {.num_ranks = world,
                    .max_tokens_per_rank = config.max_tokens_per_rank,
                    .max_hidden = config.hidden,
                    .max_topk = config.max_topk,
                    .num_experts = config.num_experts,
                    .max_channels = config.num_sms};
    group.rank = state->rank;
    for (int r = 0; r < world; ++r) group.peer_regions[r] = lease->region(r);
    group.status = state->status;
    group.timeout_ns = state->timeout_ns();
  }
  return std::unique_ptr<Buffer>(new Buffer(std::move(state)));
}

// ---------------------------------------------------------------------------------------------------------------
// Normal mode.

absl::StatusOr<DispatchLayout> Buffer::GetDispatchLayout(const TensorView& topk_idx, cudaStream_t stream) {
  State& s = *state_;
  if (absl::Status st = s.RequireMode(false, "GetDispatchLayout"); !st.ok()) return st;
  if (absl::Status st = ExpectTensor(topk_idx, "topk_idx", DType::kInt64, {-1, -1}, "[num_tokens, num_topk]");
      !st.ok()) {
    return st;
  }
  const int64_t num_tokens = topk_idx.shape[0], num_topk = topk_idx.shape[1];
  if (num_tokens > s.config.max_tokens_per_rank) {
    return Invalid("topk_idx.shape[0] (num_tokens)", num_tokens,
                   absl::StrCat("exceeds config.max_tokens_per_rank = ", s.config.max_tokens_per_rank));
  }
  if (num_topk < 1 || num_topk > s.config.max_topk) {
    return Invalid("topk_idx.shape[1] (num_topk)", num_topk,
                   absl::StrCat("must be in [1, config.max_topk = ", s.config.max_topk, "]"));
  }
  if (!s.cuda) {
    if (absl::Status st = CheckExpertIndices(static_cast<const int64_t*>(topk_idx.data), num_tokens, num_topk,
                                             s.config.num_experts, "topk_idx");
        !st.ok()) {
      return st;
    }
  }
  if (absl::Status st = s.Usable(); !st.ok()) return st;

  DispatchLayout layout;
  auto per_rank = s.NewTensor(DType::kInt32, {s.num_ranks}, stream);
  if (!per_rank.ok()) return per_rank.status();
  auto per_expert = s.NewTensor(DType::kInt32, {s.config.num_experts}, stream);
  if (!per_expert.ok()) return per_expert.status();
  auto in_rank = s.NewTensor(DType::kBool, {num_tokens, s.num_ranks}, stream);
  if (!in_rank.ok()) return in_rank.status();
  layout.num_tokens_per_rank = *std::move(per_rank);
  layout.num_tokens_per_expert = *std::move(per_expert);
  layout.is_token_in_rank = *std::move(in_rank);

  kernels::DispatchLayoutParams p;
  p.topk_idx = static_cast<const int64_t*>(topk_idx.data);
  p.num_tokens = static_cast<int>(num_tokens);
  p.num_topk = static_cast<int>(num_topk);
  p.num_experts = s.config.num_experts;
  p.num_ranks = s.num_ranks;
  p.num_tokens_per_rank = static_cast<int32_t*>(layout.num_tokens_per_rank.view.data);
  p.num_tokens_per_expert = static_cast<int32_t*>(layout.num_tokens_per_expert.view.data);
  p.is_token_in_rank = static_cast<bool*>(layout.is_token_in_rank.view.data);
  if (s.cuda) {
    // The count of invalid entries goes to a mapped host word that Dispatch reads before notify.
    const int slot = s.invalid_topk_words->Take();
    if (slot >= 0) {
      std::shared_ptr<MappedWordPool> pool = s.invalid_topk_words;
      *pool->host(slot) = -1;
      layout.num_invalid_topk.view = {const_cast<int32_t*>(pool->host(slot)), DType::kInt32, {1}};
      layout.num_invalid_topk.storage =
          std::shared_ptr<void>(pool->device(slot), [pool, slot](void*) { pool->Give(slot); });
      p.num_invalid_topk = pool->device(slot);
    }
    if (absl::Status st = kernels::GetDispatchLayout(p, stream); !st.ok()) {
      if (p.num_invalid_topk != nullptr)
        *static_cast<int32_t*>(layout.num_invalid_topk.view.data) = 0;  // nothing will write it
      return st;
    }
  } else {
    auto invalid = s.NewTensor(DType::kInt32, {1}, stream);
    if (!invalid.ok()) return invalid.status();
    layout.num_invalid_topk = *std::move(invalid);
    p.num_invalid_topk = static_cast<int32_t*>(layout.num_invalid_topk.view.data);
    if (absl::Status st = kernels::host_backend::GetDispatchLayout(p); !st.ok()) return st;
  }
  return layout;
}

namespace {

// cuda: the number of invalid top-k entries, from the layout's mapped word (bounded wait) or, for a layout the
// caller built, from a host copy of topk_idx.
absl::Status CheckDeviceExpertIndices(const DispatchArgs& args, int num_experts, uint64_t timeout_ns,
                                      cudaStream_t stream) {
  if (args.layout != nullptr && !args.layout->num_invalid_topk.view.empty() &&
      args.layout->num_invalid_topk.view.data != nullptr) {
    auto invalid = kernels::IntranodeWaitRecvCounts(
        static_cast<const volatile int32_t*>(args.layout->num_invalid_topk.view.data), timeout_ns);
    if (!invalid.ok()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the dispatch layout kernel did not report its invalid top-k count: ", invalid.status().message()));
    }
    if (*invalid > 0) {
      return absl::InvalidArgumentError(absl::StrFormat("topk_idx has %d entries outside [-1, %d) (num_experts = %d)",
                                                        *invalid, num_experts, num_experts));
    }
    return absl::OkStatus();
  }
  if (args.topk_idx.empty() || args.topk_idx.numel() == 0) return absl::OkStatus();
  std::vector<int64_t> host(args.topk_idx.numel());
  EPF_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host.data(), args.topk_idx.data, args.topk_idx.bytes(), cudaMemcpyDeviceToHost, stream));
  EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return CheckExpertIndices(host.data(), args.topk_idx.shape[0], args.topk_idx.shape[1], num_experts, "topk_idx");
}

}  // namespace

absl::StatusOr<DispatchResult> Buffer::Dispatch(const DispatchArgs& args, cudaStream_t stream) {
  State& s = *state_;
  const BufferConfig& c = s.config;
  if (absl::Status st = s.RequireMode(false, "Dispatch"); !st.ok()) return st;
  // ---- validation: nothing is launched before all of it passed ----
  const TensorView& x = args.x;
  if (x.dtype != DType::kBF16 && x.dtype != DType::kFP8E4M3) {
    return absl::InvalidArgumentError(
        absl::StrFormat("x.dtype = %s: dispatch takes bf16 or fp8_e4m3", kernels::DTypeName(x.dtype)));
  }
  const bool fp8 = x.dtype == DType::kFP8E4M3;
  if (absl::Status st = ExpectShape(x, "x", {-1, -1}, "[num_tokens, hidden]"); !st.ok()) return st;
  const int64_t num_tokens = x.shape[0], hidden = x.shape[1];
  if (num_tokens > c.max_tokens_per_rank) {
    return Invalid("x.shape[0] (num_tokens)", num_tokens,
                   absl::StrCat("exceeds config.max_tokens_per_rank = ", c.max_tokens_per_rank));
  }
  if (hidden < 1 || hidden > c.hidden) {
    return Invalid("x.shape[1] (hidden)", hidden, absl::StrCat("must be in [1, config.hidden = ", c.hidden, "]"));
  }
  if (fp8 && hidden % kernels::kFp8GroupSize != 0) {
    return Invalid("x.shape[1] (hidden)", hidden, "must be a multiple of 128 for fp8_e4m3 x");
  }
  if (!fp8 && hidden % 8 != 0) return Invalid("x.shape[1] (hidden)", hidden, "must be a multiple of 8");
  if (fp8) {
    if (args.x_scales.empty()) return absl::InvalidArgumentError("x_scales is not given: required for fp8_e4m3 x");
    if (absl::Status st = ExpectTensor(args.x_scales, "x_scales", DType::kFloat32, {num_tokens, hidden / 128},
                                       "[num_tokens, hidden / 128]");
        !st.ok()) {
      return st;
    }
  } else if (!args.x_scales.empty()) {
    return absl::InvalidArgumentError("x_scales is given for bf16 x: only fp8_e4m3 x has scales");
  }
  int64_t num_topk = 0;
  if (!args.topk_idx.empty()) {
    if (absl::Status st =
            ExpectTensor(args.topk_idx, "topk_idx", DType::kInt64, {num_tokens, -1}, "[num_tokens, num_topk]");
        !st.ok()) {
      return st;
    }
    num_topk = args.topk_idx.shape[1];
    if (num_topk < 1 || num_topk > c.max_topk) {
      return Invalid("topk_idx.shape[1] (num_topk)", num_topk,
                     absl::StrCat("must be in [1, config.max_topk = ", c.max_topk, "]"));
    }
    if (!s.cuda) {
      if (absl::Status st = CheckExpertIndices(static_cast<const int64_t*>(args.topk_idx.data), num_tokens, num_topk,
                                               c.num_experts, "topk_idx");
          !st.ok()) {
        return st;
      }
    }
  }
  if (!args.topk_weights.empty()) {
    if (args.topk_idx.empty()) return absl::InvalidArgumentError("topk_weights is given without topk_idx");
    if (absl::Status st = ExpectTensor(args.topk_weights, "topk_weights", DType::kFloat32, {num_tokens, num_topk},
                                       "[num_tokens, num_topk], as topk_idx");
        !st.ok()) {
      return st;
    }
  }
  if (args.expert_alignment < 1) return Invalid("expert_alignment", args.expert_alignment, "must be >= 1");
  const bool cached = args.cached != nullptr;
  if (cached) {
    if (args.cached->num_tokens != num_tokens) {
      return Invalid("x.shape[0] (num_tokens)", num_tokens,
                     absl::StrCat("must equal the cached handle's num_tokens = ", args.cached->num_tokens));
    }
  } else {
    if (args.layout == nullptr) return absl::InvalidArgumentError("layout is null: required unless cached");
    const DispatchLayout& l = *args.layout;
    if (absl::Status st = ExpectTensor(l.num_tokens_per_rank.view, "layout.num_tokens_per_rank", DType::kInt32,
                                       {s.num_ranks}, "[num_ranks]");
        !st.ok()) {
      return st;
    }
    if (absl::Status st = ExpectTensor(l.num_tokens_per_expert.view, "layout.num_tokens_per_expert", DType::kInt32,
                                       {c.num_experts}, "[num_experts]");
        !st.ok()) {
      return st;
    }
    if (absl::Status st = ExpectTensor(l.is_token_in_rank.view, "layout.is_token_in_rank", DType::kBool,
                                       {num_tokens, s.num_ranks}, "[num_tokens, num_ranks]");
        !st.ok()) {
      return st;
    }
    if (!s.cuda && !l.num_invalid_topk.view.empty() && l.num_invalid_topk.view.data != nullptr &&
        *static_cast<const int32_t*>(l.num_invalid_topk.view.data) != 0) {
      return Invalid("layout.num_invalid_topk", *static_cast<const int32_t*>(l.num_invalid_topk.view.data),
                     "the layout was computed from top-k entries outside [-1, num_experts)");
    }
  }
  if (absl::Status st = s.Usable(); !st.ok()) return st;
  if (s.cuda && !cached) {
    if (absl::Status st = CheckDeviceExpertIndices(args, c.num_experts, s.timeout_ns(), stream); !st.ok()) return st;
  }

  // ---- notify (unless cached): exchange the counts and learn how many rows arrive ----
  auto handle = std::make_shared<DispatchHandle>();
  handle->num_tokens = static_cast<int>(num_tokens);
  handle->hidden = static_cast<int>(hidden);
  DispatchResult result;
  if (cached) {
    handle->is_token_in_rank = args.cached->is_token_in_rank;
    handle->rank_prefix_matrix = args.cached->rank_prefix_matrix;
    handle->num_recv_tokens = args.cached->num_recv_tokens;
  } else {
    handle->is_token_in_rank = args.layout->is_token_in_rank;
    auto prefix = s.NewTensor(DType::kInt32, {s.num_ranks, s.num_ranks}, stream);
    if (!prefix.ok()) return prefix.status();
    handle->rank_prefix_matrix = *std::move(prefix);
    kernels::IntranodeNotifyParams np;
    np.num_tokens_per_rank = static_cast<const int32_t*>(args.layout->num_tokens_per_rank.view.data);
    np.num_tokens_per_expert = static_cast<const int32_t*>(args.layout->num_tokens_per_expert.view.data);
    np.num_tokens = static_cast<int>(num_tokens);
    np.num_experts = c.num_experts;
    np.expert_alignment = args.expert_alignment;
    np.rank_prefix_matrix = static_cast<int32_t*>(handle->rank_prefix_matrix.view.data);
    np.host_num_recv_tokens = s.device_counters;
    np.host_num_recv_tokens_per_expert = s.device_counters + 1;
    std::fill(s.host_counters, s.host_counters + 1 + s.experts_per_rank, -1);
    absl::Status notified =
        s.cuda ? kernels::IntranodeNotify(s.group, np, stream) : kernels::host_backend::IntranodeNotify(s.group, np);
    if (!notified.ok()) return notified;
    // The kernel gives up after timeout_ns and records whom it waited for; wait a little longer than that so the
    // record, not this wait, names the peer.
    auto num_recv = kernels::IntranodeWaitRecvCounts(s.host_counters, s.timeout_ns() + 1000ull * 1000 * 1000);
    if (!num_recv.ok()) return s.KernelStatusOr(num_recv.status(), stream);
    handle->num_recv_tokens = *num_recv;
    result.num_recv_tokens_per_expert.assign(s.host_counters + 1, s.host_counters + 1 + s.experts_per_rank);
  }
  const int64_t num_recv = handle->num_recv_tokens;

  // ---- outputs ----
  auto recv_x = s.NewTensor(x.dtype, {num_recv, hidden}, stream);
  if (!recv_x.ok()) return recv_x.status();
  result.recv_x = *std::move(recv_x);
  if (fp8) {
    auto scales = s.NewTensor(DType::kFloat32, {num_recv, hidden / 128}, stream);
    if (!scales.ok()) return scales.status();
    result.recv_x_scales = *std::move(scales);
  }
  if (num_topk > 0) {
    auto idx = s.NewTensor(DType::kInt64, {num_recv, num_topk}, stream);
    if (!idx.ok()) return idx.status();
    result.recv_topk_idx = *std::move(idx);
    if (!args.topk_weights.empty()) {
      auto w = s.NewTensor(DType::kFloat32, {num_recv, num_topk}, stream);
      if (!w.ok()) return w.status();
      result.recv_topk_weights = *std::move(w);
    }
  }
  auto channel_prefix = s.NewTensor(DType::kInt32, {s.num_ranks, c.num_sms}, stream);
  auto send_slot = s.NewTensor(DType::kInt32, {num_tokens, s.num_ranks}, stream);
  auto src_idx = s.NewTensor(DType::kInt32, {num_recv}, stream);
  if (!channel_prefix.ok()) return channel_prefix.status();
  if (!send_slot.ok()) return send_slot.status();
  if (!src_idx.ok()) return src_idx.status();
  handle->recv_channel_prefix = *std::move(channel_prefix);
  handle->send_slot = *std::move(send_slot);
  handle->recv_src_idx = *std::move(src_idx);

  kernels::IntranodeHandle& raw = handle->raw;
  raw.num_tokens = handle->num_tokens;
  raw.num_recv_tokens = handle->num_recv_tokens;
  raw.is_token_in_rank = static_cast<const bool*>(handle->is_token_in_rank.view.data);
  raw.rank_prefix_matrix = static_cast<int32_t*>(handle->rank_prefix_matrix.view.data);
  raw.recv_channel_prefix = static_cast<int32_t*>(handle->recv_channel_prefix.view.data);
  raw.send_slot = static_cast<int32_t*>(handle->send_slot.view.data);
  raw.recv_src_idx = static_cast<int32_t*>(handle->recv_src_idx.view.data);

  kernels::IntranodeDispatchParams dp;
  dp.x = GivenPointer<const void>(x);
  dp.x_dtype = x.dtype;
  dp.x_scales = fp8 ? GivenPointer<const float>(args.x_scales) : nullptr;
  dp.hidden = static_cast<int>(hidden);
  dp.topk_idx = GivenPointer<const int64_t>(args.topk_idx);
  dp.topk_weights = GivenPointer<const float>(args.topk_weights);
  dp.num_topk = static_cast<int>(num_topk);
  dp.num_experts = c.num_experts;
  dp.num_sms = c.num_sms;
  dp.recv_capacity = static_cast<int>(num_recv);
  dp.recv_x = result.recv_x.view.data;
  dp.recv_x_scales = fp8 ? static_cast<float*>(result.recv_x_scales.view.data) : nullptr;
  dp.recv_topk_idx = num_topk > 0 ? static_cast<int64_t*>(result.recv_topk_idx.view.data) : nullptr;
  dp.recv_topk_weights = !args.topk_weights.empty() ? static_cast<float*>(result.recv_topk_weights.view.data) : nullptr;
  absl::Status dispatched = s.cuda ? kernels::IntranodeDispatch(s.group, dp, &raw, stream)
                                   : kernels::host_backend::IntranodeDispatch(s.group, dp, &raw);
  if (!dispatched.ok()) return dispatched;
  result.handle = std::move(handle);
  return result;
}

absl::StatusOr<CombineResult> Buffer::Combine(const CombineArgs& args, cudaStream_t stream) {
  State& s = *state_;
  const BufferConfig& c = s.config;
  if (absl::Status st = s.RequireMode(false, "Combine"); !st.ok()) return st;
  if (args.handle == nullptr) return absl::InvalidArgumentError("handle is null: pass the dispatch's handle");
  const DispatchHandle& h = *args.handle;
  if (absl::Status st = ExpectDType(args.x, "x", DType::kBF16); !st.ok()) return st;
  if (absl::Status st = ExpectShape(args.x, "x", {h.num_recv_tokens, -1}, "[num_recv_tokens of the handle, hidden]");
      !st.ok()) {
    return st;
  }
  const int64_t hidden = args.x.shape[1];
  if (hidden < 8 || hidden > c.hidden || hidden % 8 != 0) {
    return Invalid("x.shape[1] (hidden)", hidden,
                   absl::StrCat("must be a multiple of 8 in [8, config.hidden = ", c.hidden, "]"));
  }
  int64_t num_topk = 0;
  if (!args.topk_weights.empty()) {
    if (absl::Status st = ExpectTensor(args.topk_weights, "topk_weights", DType::kFloat32, {h.num_recv_tokens, -1},
                                       "[num_recv_tokens, num_topk]");
        !st.ok()) {
      return st;
    }
    num_topk = args.topk_weights.shape[1];
    if (num_topk < 1 || num_topk > c.max_topk) {
      return Invalid("topk_weights.shape[1] (num_topk)", num_topk,
                     absl::StrCat("must be in [1, config.max_topk = ", c.max_topk, "]"));
    }
  }
  const TensorView* biases[2] = {&args.bias_0, &args.bias_1};
  const char* bias_names[2] = {"bias_0", "bias_1"};
  for (int i = 0; i < 2; ++i) {
    if (biases[i]->empty()) continue;
    if (absl::Status st =
            ExpectTensor(*biases[i], bias_names[i], DType::kBF16, {h.num_tokens, hidden}, "[num_tokens, hidden]");
        !st.ok()) {
      return st;
    }
  }
  if (absl::Status st = s.Usable(); !st.ok()) return st;

  CombineResult result;
  auto combined = s.NewTensor(DType::kBF16, {h.num_tokens, hidden}, stream);
  if (!combined.ok()) return combined.status();
  result.combined_x = *std::move(combined);
  if (num_topk > 0) {
    auto w = s.NewTensor(DType::kFloat32, {h.num_tokens, num_topk}, stream);
    if (!w.ok()) return w.status();
    result.combined_topk_weights = *std::move(w);
  }
  kernels::IntranodeCombineParams cp;
  cp.x = GivenPointer<const void>(args.x);
  cp.hidden = static_cast<int>(hidden);
  cp.topk_weights = GivenPointer<const float>(args.topk_weights);
  cp.num_topk = static_cast<int>(num_topk);
  cp.bias_0 = GivenPointer<const void>(args.bias_0);
  cp.bias_1 = GivenPointer<const void>(args.bias_1);
  cp.combined_x = result.combined_x.view.data;
  cp.combined_topk_weights = num_topk > 0 ? static_cast<float*>(result.combined_topk_weights.view.data) : nullptr;
  absl::Status st = s.cuda ? kernels::IntranodeCombine(s.group, cp, h.raw, stream)
                           : kernels::host_backend::IntranodeCombine(s.group, cp, h.raw);
  if (!st.ok()) return st;
  return result;
}

// ---------------------------------------------------------------------------------------------------------------
// Low-latency mode.

absl::StatusOr<LowLatencyDispatchResult> Buffer::LowLatencyDispatch(const LowLatencyDispatchArgs& args,
                                                                    cudaStream_t stream) {
  State& s = *state_;
  const BufferConfig& c = s.config;
  if (absl::Status st = s.RequireMode(true, "LowLatencyDispatch"); !st.ok()) return st;
  if (absl::Status st = ExpectDType(args.x, "x", DType::kBF16); !st.ok()) return st;
  if (absl::Status st = ExpectShape(args.x, "x", {-1, c.hidden}, "[num_tokens, config.hidden]"); !st.ok()) return st;
  const int64_t num_tokens = args.x.shape[0];
  if (num_tokens > c.max_tokens_per_rank) {
    return Invalid("x.shape[0] (num_tokens)", num_tokens,
                   absl::StrCat("exceeds config.max_tokens_per_rank = ", c.max_tokens_per_rank));
  }
  if (c.hidden % kernels::kFp8GroupSize != 0) {
    return Invalid("config.hidden", c.hidden, "must be a multiple of 128 in low-latency mode");
  }
  if (absl::Status st =
          ExpectTensor(args.topk_idx, "topk_idx", DType::kInt64, {num_tokens, -1}, "[num_tokens, num_topk]");
      !st.ok()) {
    return st;
  }
  const int64_t num_topk = args.topk_idx.shape[1];
  const int64_t max_topk = std::min(c.max_topk, kernels::kLowLatencyMaxTopk);
  if (num_topk < 1 || num_topk > max_topk) {
    return Invalid("topk_idx.shape[1] (num_topk)", num_topk, absl::StrCat("must be in [1, ", max_topk, "]"));
  }
  if (args.use_ue8m0 && !(args.use_fp8 && args.round_scale)) {
    return absl::InvalidArgumentError("use_ue8m0 = true needs use_fp8 = true and round_scale = true");
  }
  if (args.use_ue8m0 && c.hidden % 512 != 0) {
    return Invalid("config.hidden", c.hidden, "must be a multiple of 512 with use_ue8m0 (4 scales per int32)");
  }
  if (!args.cumulative_stats.empty()) {
    if (absl::Status st = ExpectTensor(args.cumulative_stats, "cumulative_stats", DType::kInt32, {s.experts_per_rank},
                                       "[num_local_experts]");
        !st.ok()) {
      return st;
    }
  }
  if (!s.cuda) {
    if (absl::Status st = CheckExpertIndices(static_cast<const int64_t*>(args.topk_idx.data), num_tokens, num_topk,
                                             c.num_experts, "topk_idx");
        !st.ok()) {
      return st;
    }
  }
  if (absl::Status st = s.Usable(); !st.ok()) return st;

  const int64_t L = s.experts_per_rank, R = s.num_ranks, M = c.max_tokens_per_rank, H = c.hidden, G = H / 128;
  LowLatencyDispatchResult result;
  auto handle = std::make_shared<LowLatencyHandle>();
  auto packed_x = s.NewTensor(args.use_fp8 ? DType::kFP8E4M3 : DType::kBF16, {L, R * M, H}, stream);
  if (!packed_x.ok()) return packed_x.status();
  result.packed_recv_x = *std::move(packed_x);
  if (args.use_fp8) {
    auto scales = args.use_ue8m0 ? s.NewTensor(DType::kInt32, {L, G / 4, R * M}, stream)
                                 : s.NewTensor(DType::kFloat32, {L, G, R * M}, stream);
    if (!scales.ok()) return scales.status();
    result.packed_recv_x_scales = *std::move(scales);
  }
  auto count = s.NewTensor(DType::kInt32, {L}, stream);
  auto src_info = s.NewTensor(DType::kInt32, {L, R * M}, stream);
  auto layout_range = s.NewTensor(DType::kInt64, {L, R}, stream);
  auto topk_slot = s.NewTensor(DType::kInt32, {L, R * M}, stream);
  auto token_map = s.NewTensor(DType::kInt32, {R, M, kernels::kLowLatencyMaxTopk}, stream);
  for (auto* t : {&count, &src_info, &layout_range, &topk_slot, &token_map}) {
    if (!t->ok()) return t->status();
  }
  result.packed_recv_count = *std::move(count);
  result.packed_recv_src_info = *std::move(src_info);
  result.packed_recv_layout_range = *std::move(layout_range);
  // The handle shares src_info and layout_range with the result (views of the same allocations).
  handle->src_info = result.packed_recv_src_info;
  handle->layout_range = result.packed_recv_layout_range;
  handle->topk_slot = *std::move(topk_slot);
  handle->token_map = *std::move(token_map);
  handle->raw.packed_recv_src_info = static_cast<const int32_t*>(handle->src_info.view.data);
  handle->raw.packed_recv_layout_range = static_cast<const int64_t*>(handle->layout_range.view.data);
  handle->raw.packed_recv_topk_slot = static_cast<const int32_t*>(handle->topk_slot.view.data);
  handle->raw.packed_recv_token_map = static_cast<const int32_t*>(handle->token_map.view.data);
  handle->raw.num_tokens = static_cast<int>(num_tokens);

  kernels::LowLatencyDispatchArgs d;
  d.x = GivenPointer<const void>(args.x);
  d.topk_idx = GivenPointer<const int64_t>(args.topk_idx);
  d.num_tokens = static_cast<int>(num_tokens);
  d.num_topk = static_cast<int>(num_topk);
  d.hidden = c.hidden;
  d.max_tokens_per_rank = c.max_tokens_per_rank;
  d.num_experts = c.num_experts;
  d.use_fp8 = args.use_fp8;
  d.round_scale = args.round_scale;
  d.use_ue8m0 = args.use_ue8m0;
  d.cumulative_stats = args.cumulative_stats.empty() ? nullptr : static_cast<int32_t*>(args.cumulative_stats.data);
  d.packed_recv_x = result.packed_recv_x.view.data;
  d.packed_recv_x_scales = args.use_fp8 ? result.packed_recv_x_scales.view.data : nullptr;
  d.packed_recv_count = static_cast<int32_t*>(result.packed_recv_count.view.data);
  d.packed_recv_src_info = static_cast<int32_t*>(result.packed_recv_src_info.view.data);
  d.packed_recv_layout_range = static_cast<int64_t*>(result.packed_recv_layout_range.view.data);
  d.packed_recv_topk_slot = static_cast<int32_t*>(handle->topk_slot.view.data);
  d.packed_recv_token_map = static_cast<int32_t*>(handle->token_map.view.data);
  if (absl::Status st = kernels::ValidateLowLatencyDispatch(s.ll, d); !st.ok()) return st;
  d.buffer_half = s.cursor.Next();
  handle->buffer_half = d.buffer_half;
  d.phases = args.return_recv_hook ? kernels::LowLatencyPhases::kSend : kernels::LowLatencyPhases::kSendAndRecv;
  absl::Status st =
      s.cuda ? kernels::LowLatencyDispatch(s.ll, d, stream) : kernels::host_backend::LowLatencyDispatch(s.ll, d);
  if (!st.ok()) return st;
  if (args.return_recv_hook) {
    s.recv_hook_pending = true;
    State* state = state_.get();
    // The hook keeps the outputs alive until it ran (it writes into them).
    auto keep = std::make_shared<LowLatencyDispatchResult>(result);
    keep->handle = handle;
    auto ran = std::make_shared<bool>(false);
    d.phases = kernels::LowLatencyPhases::kRecv;
    result.recv_hook = [state, d, keep, ran](cudaStream_t hook_stream) -> absl::Status {
      if (*ran) return absl::FailedPreconditionError("this low-latency dispatch recv_hook has already run");
      *ran = true;
      state->recv_hook_pending = false;
      return state->cuda ? kernels::LowLatencyDispatch(state->ll, d, hook_stream)
                         : kernels::host_backend::LowLatencyDispatch(state->ll, d);
    };
  }
  result.handle = std::move(handle);
  return result;
}

absl::StatusOr<LowLatencyCombineResult> Buffer::LowLatencyCombine(const LowLatencyCombineArgs& args,
                                                                  cudaStream_t stream) {
  State& s = *state_;
  const BufferConfig& c = s.config;
  if (absl::Status st = s.RequireMode(true, "LowLatencyCombine"); !st.ok()) return st;
  if (args.handle == nullptr) return absl::InvalidArgumentError("handle is null: pass the dispatch's handle");
  const LowLatencyHandle& h = *args.handle;
  const int64_t L = s.experts_per_rank, R = s.num_ranks, M = c.max_tokens_per_rank, H = c.hidden;
  const int64_t num_tokens = h.raw.num_tokens;
  if (!args.zero_copy) {
    if (absl::Status st = ExpectTensor(args.x, "x", DType::kBF16, {L, R * M, H},
                                       "[num_local_experts, num_ranks * max_tokens_per_rank, hidden]");
        !st.ok()) {
      return st;
    }
  }
  if (absl::Status st = ExpectTensor(args.topk_idx, "topk_idx", DType::kInt64, {num_tokens, -1},
                                     "[num_tokens of the dispatch, num_topk]");
      !st.ok()) {
    return st;
  }
  const int64_t num_topk = args.topk_idx.shape[1];
  const int64_t max_topk = std::min(c.max_topk, kernels::kLowLatencyMaxTopk);
  if (num_topk < 1 || num_topk > max_topk) {
    return Invalid("topk_idx.shape[1] (num_topk)", num_topk, absl::StrCat("must be in [1, ", max_topk, "]"));
  }
  if (absl::Status st = ExpectTensor(args.topk_weights, "topk_weights", DType::kFloat32, {num_tokens, num_topk},
                                     "[num_tokens, num_topk], as topk_idx");
      !st.ok()) {
    return st;
  }
  if (!s.cuda) {
    if (absl::Status st = CheckExpertIndices(static_cast<const int64_t*>(args.topk_idx.data), num_tokens, num_topk,
                                             c.num_experts, "topk_idx");
        !st.ok()) {
      return st;
    }
  }
  if (absl::Status st = s.Usable(); !st.ok()) return st;

  LowLatencyCombineResult result;
  auto combined = s.NewTensor(DType::kBF16, {num_tokens, H}, stream);
  if (!combined.ok()) return combined.status();
  result.combined_x = *std::move(combined);
  kernels::LowLatencyCombineArgs cb;
  cb.x = args.zero_copy ? nullptr : GivenPointer<const void>(args.x);
  cb.topk_idx = GivenPointer<const int64_t>(args.topk_idx);
  cb.topk_weights = GivenPointer<const float>(args.topk_weights);
  cb.num_tokens = static_cast<int>(num_tokens);
  cb.num_topk = static_cast<int>(num_topk);
  cb.hidden = c.hidden;
  cb.max_tokens_per_rank = c.max_tokens_per_rank;
  cb.num_experts = c.num_experts;
  cb.handle = h.raw;
  cb.zero_copy = args.zero_copy;
  cb.combined_x = result.combined_x.view.data;
  if (absl::Status st = kernels::ValidateLowLatencyCombine(s.ll, cb); !st.ok()) return st;
  cb.buffer_half = s.cursor.Next();
  cb.phases = args.return_recv_hook ? kernels::LowLatencyPhases::kSend : kernels::LowLatencyPhases::kSendAndRecv;
  absl::Status st =
      s.cuda ? kernels::LowLatencyCombine(s.ll, cb, stream) : kernels::host_backend::LowLatencyCombine(s.ll, cb);
  if (!st.ok()) return st;
  if (args.return_recv_hook) {
    s.recv_hook_pending = true;
    State* state = state_.get();
    auto keep_out = std::make_shared<Tensor>(result.combined_x);
    std::shared_ptr<const LowLatencyHandle> keep_handle = args.handle;
    auto ran = std::make_shared<bool>(false);
    cb.phases = kernels::LowLatencyPhases::kRecv;
    result.recv_hook = [state, cb, keep_out, keep_handle, ran](cudaStream_t hook_stream) -> absl::Status {
      if (*ran) return absl::FailedPreconditionError("this low-latency combine recv_hook has already run");
      *ran = true;
      state->recv_hook_pending = false;
      return state->cuda ? kernels::LowLatencyCombine(state->ll, cb, hook_stream)
                         : kernels::host_backend::LowLatencyCombine(state->ll, cb);
    };
  }
  return result;
}

TensorView Buffer::NextLowLatencyCombineBuffer() const {
  const State& s = *state_;
  if (!s.config.low_latency) return {};
  return TensorView{
      kernels::LowLatencyCombineInputBuffer(s.ll),
      DType::kBF16,
      {s.experts_per_rank, static_cast<int64_t>(s.num_ranks) * s.config.max_tokens_per_rank, s.config.hidden}};
}

absl::Status Buffer::Check(cudaStream_t stream) {
  State& s = *state_;
  if (!s.cuda) return absl::OkStatus();
  absl::Status kernel = kernels::ReadKernelStatus(s.status, stream);
  if (!kernel.ok() && absl::IsDeadlineExceeded(kernel)) {
    if (absl::Status cleared = kernels::ClearKernelStatus(s.status, stream); !cleared.ok()) return cleared;
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  return kernel;
}

absl::Status Buffer::Reset(cudaStream_t stream) {
  State& s = *state_;
  s.recv_hook_pending = false;
  s.cursor = kernels::LowLatencyBufferCursor();
  if (!s.cuda) {
    s.host_status = {};
    std::fill(s.host_rank_mask.begin(), s.host_rank_mask.end(), 0);
    return s.config.low_latency ? kernels::host_backend::LowLatencyResetRegion(s.ll)
                                : kernels::host_backend::IntranodeResetRegion(s.group);
  }
  if (s.config.low_latency) {
    // Both halves' signals (the only part of a half that is ever cleaned) and the rank mask.
    char* own = static_cast<char*>(s.ll.peer_regions[s.rank]);
    EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(own, 0, s.ll.layout.signal_bytes, stream));
    EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(own + s.ll.layout.half_bytes, 0, s.ll.layout.signal_bytes, stream));
    EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(s.rank_mask, 0, sizeof(int32_t) * s.num_ranks, stream));
  } else {
    if (absl::Status st = kernels::IntranodeResetRegion(s.group, stream); !st.ok()) return st;
  }
  if (absl::Status st = kernels::ClearKernelStatus(s.status, stream); !st.ok()) return st;
  EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace epfabric::client
