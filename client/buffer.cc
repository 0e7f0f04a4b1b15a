// The Buffer API over a Lease: creation (the region checks and the choice of the data path), output allocation, the
// checks of TensorViews, and the calls that are not one mode's (Check, Reset). The modes are in buffer_normal.cc and
// buffer_low_latency.cc; the backends in data_path_cuda.cc and data_path_host.cc. docs/data-layout.md describes every
// output.
#include "epfabric/client/buffer.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "buffer_internal.h"
#include "epfabric/common/status_macros.h"
#include "internode_low_latency.h"

namespace epfabric::client {
namespace {

using kernels::DType;
using kernels::InvalidValue;

constexpr size_t kMinAllocationBytes = 256;  // never hand a kernel a null pointer for a given, empty tensor

const char* BoolName(bool value) { return value ? "true" : "false"; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

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

absl::Status GroupUsable(const Lease& lease) {
  if (absl::Status healthy = lease.Healthy(); !healthy.ok()) {
    return absl::UnavailableError(absl::StrCat("the group is not usable: ", healthy.message()));
  }
  return absl::OkStatus();
}

// The part of every rank's regions that a Buffer of one mode uses: the whole regions, or in a low-latency group that
// serves both modes (GroupInfo.num_normal_bytes, and num_normal_rdma_bytes across hosts) the normal parts at their
// starts or the low-latency parts after them.
struct RegionPart {
  uint64_t offset = 0;
  uint64_t limit = UINT64_MAX;  // at most this many bytes from `offset` (besides the region's own size)
  const char* name = "region";
};
struct ModeParts {
  RegionPart nvl;
  RegionPart rdma;
};

absl::StatusOr<ModeParts> PartFor(const Lease& lease, const BufferConfig& config) {
  const v1::GroupInfo& group = lease.group();
  if (config.low_latency && !group.low_latency()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config.low_latency = true but group '%s' was created with low_latency = false", lease.group_name()));
  }
  if (!group.low_latency() || (config.low_latency && group.num_normal_bytes() == 0)) return ModeParts{};
  if (group.num_normal_bytes() == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config.low_latency = false but group '%s' was created with low_latency = true and no normal-mode part "
        "(CreateGroup's num_normal_bytes = 0)",
        lease.group_name()));
  }
  // The daemons check that a group with an RDMA region splits it too (num_normal_rdma_bytes).
  if (config.low_latency) {
    return ModeParts{.nvl = {.offset = group.num_normal_bytes(), .name = "low-latency part"},
                     .rdma = {.offset = group.num_normal_rdma_bytes(), .name = "low-latency part of the RDMA region"}};
  }
  return ModeParts{.nvl = {.limit = group.num_normal_bytes(), .name = "normal-mode part"},
                   .rdma = {.limit = group.num_normal_rdma_bytes(), .name = "normal-mode part of the RDMA region"}};
}

// Every rank in `ranks` has its region mapped, with at least `required` bytes in `part`.
absl::Status CheckRegions(const Lease& lease, const BufferConfig& config, const std::vector<int>& ranks,
                          uint64_t required, const RegionPart& part = {}) {
  for (int r : ranks) {
    if (lease.region(r) == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat("region of rank %d is not mapped", r));
    }
    const uint64_t size = lease.region_bytes(r);
    const uint64_t available = size <= part.offset ? 0 : std::min(size - part.offset, part.limit);
    if (available < required) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s of rank %d has %d bytes; config (max_tokens_per_rank %d, hidden %d, max_topk %d, num_experts %d, "
          "num_sms %d, low_latency %s) needs RequiredRegionBytes = %d (across hosts: RequiredGroupBytes)",
          part.name, r, available, config.max_tokens_per_rank, config.hidden, config.max_topk, config.num_experts,
          config.num_sms, BoolName(config.low_latency), required));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---- internal helpers (buffer_internal.h) ----

namespace internal {

absl::StatusOr<Tensor> NewTensor(const std::shared_ptr<Allocator>& allocator, DType dtype, std::vector<int64_t> shape,
                                 cudaStream_t stream) {
  Tensor t;
  t.view.dtype = dtype;
  t.view.shape = std::move(shape);
  EPF_ASSIGN_OR_RETURN(t.view.data, allocator->AllocateTensor(dtype, t.view.shape, t.view.bytes(), stream));
  if (t.view.data == nullptr) return absl::ResourceExhaustedError("the allocator returned a null pointer");
  std::shared_ptr<Allocator> owner = allocator;
  t.storage = std::shared_ptr<void>(t.view.data, [owner, stream](void* p) { owner->Free(p, stream); });
  return t;
}

absl::StatusOr<std::vector<Tensor>> NewTensors(const std::shared_ptr<Allocator>& allocator,
                                               const std::vector<TensorSpec>& specs, cudaStream_t stream) {
  std::vector<Tensor> tensors(specs.size());
  std::vector<size_t> offsets(specs.size());
  size_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    tensors[i].view.dtype = specs[i].dtype;
    tensors[i].view.shape = specs[i].shape;
    offsets[i] = total;
    total += (std::max<size_t>(tensors[i].view.bytes(), 1) + kMinAllocationBytes - 1) / kMinAllocationBytes *
             kMinAllocationBytes;
  }
  // One int32 tensor of the block's size, so that a typed allocator (AllocateTensor) can serve it too.
  EPF_ASSIGN_OR_RETURN(Tensor block,
                       NewTensor(allocator, DType::kInt32, {static_cast<int64_t>(total / sizeof(int32_t))}, stream));
  for (size_t i = 0; i < specs.size(); ++i) {
    tensors[i].view.data = static_cast<char*>(block.view.data) + offsets[i];
    tensors[i].storage = std::shared_ptr<void>(block.storage, tensors[i].view.data);  // aliases the block
  }
  return tensors;
}

absl::Status ExpectDType(const TensorView& t, const char* name, DType want) {
  if (t.dtype != want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.dtype = %s: expected %s", name, kernels::DTypeName(t.dtype), kernels::DTypeName(want)));
  }
  return absl::OkStatus();
}

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
  EPF_RETURN_IF_ERROR(ExpectDType(t, name, dtype));
  return ExpectShape(t, name, shape, meaning);
}

const void* GivenData(const TensorView& t) {
  alignas(256) static uint64_t dummy[32] = {};
  if (t.empty()) return nullptr;
  return t.data != nullptr ? t.data : static_cast<const void*>(dummy);
}

}  // namespace internal

// ---- TensorView, allocators, sizes ----

absl::StatusOr<void*> Allocator::AllocateTensor(DType /*dtype*/, const std::vector<int64_t>& /*shape*/, size_t bytes,
                                                cudaStream_t stream) {
  return Allocate(std::max(bytes, kMinAllocationBytes), stream);
}

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
  // A low-latency region holds the layout over every rank of the group, across hosts too (DeepEP's size hint takes
  // the whole group): up to kMaxLowLatencyRanks. Normal mode's spans one NVLink domain.
  const int max_ranks = config.low_latency ? kernels::kMaxLowLatencyRanks : kernels::kMaxNvlPeers;
  if (num_nvl_ranks < 1 || num_nvl_ranks > max_ranks) {
    return InvalidValue("num_nvl_ranks", num_nvl_ranks, absl::StrCat("must be in [1, ", max_ranks, "]"));
  }
  if (config.max_tokens_per_rank < 1) {
    return InvalidValue("config.max_tokens_per_rank", config.max_tokens_per_rank, "must be >= 1");
  }
  if (config.hidden < 1) return InvalidValue("config.hidden", config.hidden, "must be >= 1");
  if (config.max_topk < 1) return InvalidValue("config.max_topk", config.max_topk, "must be >= 1");
  if (config.num_experts < 1 || config.num_experts % num_nvl_ranks != 0) {
    return InvalidValue("config.num_experts", config.num_experts,
                        absl::StrCat("must be a positive multiple of the number of ranks (", num_nvl_ranks, ")"));
  }
  if (config.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.timeout = ", absl::FormatDuration(config.timeout), ": must be positive"));
  }
  if (config.low_latency) {
    if (config.max_topk > kernels::kLowLatencyMaxTopk) {
      return InvalidValue("config.max_topk", config.max_topk,
                          absl::StrCat("must be at most ", kernels::kLowLatencyMaxTopk, " in low-latency mode"));
    }
    EPF_ASSIGN_OR_RETURN(const size_t bytes, kernels::LowLatencyRegionBytes(config.max_tokens_per_rank, config.hidden,
                                                                            num_nvl_ranks, config.num_experts));
    return static_cast<uint64_t>(bytes);
  }
  if (config.num_sms < 1) return InvalidValue("config.num_sms", config.num_sms, "must be >= 1");
  kernels::IntranodeRegionConfig region{.num_ranks = num_nvl_ranks,
                                        .max_tokens_per_rank = config.max_tokens_per_rank,
                                        .max_hidden = config.hidden,
                                        .max_topk = config.max_topk,
                                        .num_experts = config.num_experts,
                                        .max_channels = config.num_sms};
  EPF_ASSIGN_OR_RETURN(const size_t bytes, kernels::IntranodeRegionBytes(region));
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<GroupBytes> RequiredGroupBytes(const BufferConfig& config, int num_hosts, int ranks_per_host) {
  if (num_hosts < 1 || num_hosts > kernels::kMaxInternodeHosts) {
    return InvalidValue("num_hosts", num_hosts, absl::StrCat("must be in [1, ", kernels::kMaxInternodeHosts, "]"));
  }
  if (config.num_experts % (num_hosts * std::max(ranks_per_host, 1)) != 0) {
    return InvalidValue("config.num_experts", config.num_experts,
                        absl::StrCat("must be a multiple of the number of ranks (", num_hosts * ranks_per_host, ")"));
  }
  GroupBytes bytes;
  if (num_hosts == 1 && !config.force_internode) {
    EPF_ASSIGN_OR_RETURN(bytes.nvl, RequiredRegionBytes(config, ranks_per_host));
    return bytes;
  }
  if (config.low_latency) {
    const int world = num_hosts * ranks_per_host;
    EPF_ASSIGN_OR_RETURN(
        const kernels::LowLatencyLayout layout,
        kernels::MakeLowLatencyLayout(config.max_tokens_per_rank, config.hidden, world, config.num_experts));
    bytes.nvl = layout.total_bytes;
    bytes.rdma = internal::LowLatencyInternodeRdmaBytes(layout);
    return bytes;
  }

  const internal::InternodeGroupShape shape{.num_hosts = num_hosts, .ranks_per_host = ranks_per_host};
  EPF_ASSIGN_OR_RETURN(bytes.nvl, RequiredRegionBytes(internal::InnerBufferConfig(config, shape), ranks_per_host));
  EPF_ASSIGN_OR_RETURN(const kernels::InternodeRdmaLayout layout,
                       kernels::ComputeInternodeRdmaLayout({.num_hosts = num_hosts,
                                                            .ranks_per_host = ranks_per_host,
                                                            .max_tokens_per_rank = config.max_tokens_per_rank,
                                                            .max_hidden = config.hidden,
                                                            .max_topk = config.max_topk}));
  bytes.rdma = layout.total_bytes;
  return bytes;
}

// ---- Buffer ----

absl::Status Buffer::State::Usable() const { return GroupUsable(*lease); }

absl::Status Buffer::State::RequireMode(bool low_latency, const char* call) const {
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

Buffer::Buffer(std::unique_ptr<State> state) : state_(std::move(state)) {}
Buffer::~Buffer() = default;

int Buffer::rank() const { return state_->rank; }
int Buffer::num_ranks() const { return state_->num_ranks; }
v1::Backend Buffer::backend() const { return state_->path->backend(); }
const BufferConfig& Buffer::config() const { return state_->config; }

absl::StatusOr<std::unique_ptr<Buffer>> Buffer::Create(Lease* lease, BufferConfig config,
                                                       std::shared_ptr<Allocator> allocator) {
  if (lease == nullptr) return absl::InvalidArgumentError("lease is null");
  EPF_RETURN_IF_ERROR(GroupUsable(*lease));
  EPF_ASSIGN_OR_RETURN(const ModeParts parts, PartFor(*lease, config));
  const RegionPart& part = parts.nvl;
  const v1::Backend backend = lease->backend();
  if (backend != v1::BACKEND_CUDA && backend != v1::BACKEND_HOST) {
    return absl::InvalidArgumentError(absl::StrCat("lease backend = ", v1::Backend_Name(backend), ": not supported"));
  }
  const int world = lease->world_size();
  if (static_cast<int>(lease->nvl_ranks().size()) != world || config.force_internode) {
    if (config.low_latency) {
      return CreateLowLatencyInternode(lease, config, std::move(allocator), part.offset, parts.rdma.offset);
    }
    return CreateInternode(lease, config, std::move(allocator), part.limit, parts.rdma.limit);
  }
  if (world > kernels::kMaxNvlPeers) {
    return InvalidValue("world_size", world, absl::StrCat("at most ", kernels::kMaxNvlPeers, " same-host ranks"));
  }
  EPF_ASSIGN_OR_RETURN(const uint64_t required, RequiredRegionBytes(config, world));
  std::vector<int> ranks(world);
  for (int r = 0; r < world; ++r) ranks[r] = r;
  EPF_RETURN_IF_ERROR(CheckRegions(*lease, config, ranks, required, part));
  allocator = allocator != nullptr ? std::move(allocator) : DefaultAllocator(backend);
  EPF_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> buffer,
                       CreateOver(lease, config, lease->rank(), ranks, std::move(allocator), part.offset));
  EPF_RETURN_IF_ERROR(buffer->CountInto(lease));
  return buffer;
}

absl::Status Buffer::CountInto(Lease* lease) {
  EPF_ASSIGN_OR_RETURN(state_->stats,
                       internal::DataPathRecorder::Create(lease->datapath_stats(), lease->backend(),
                                                          state_->experts_per_rank, state_->config.low_latency));
  if (state_->config.low_latency) state_->stats->SetRankMask(state_->path->LowLatencyRankMask(), state_->num_ranks);
  return absl::OkStatus();
}

// A Buffer whose data path runs over `ranks` (group ranks on this host, in their order), as rank `rank` of them.
absl::StatusOr<std::unique_ptr<Buffer>> Buffer::CreateOver(Lease* lease, const BufferConfig& config, int rank,
                                                           const std::vector<int>& ranks,
                                                           std::shared_ptr<Allocator> allocator,
                                                           uint64_t region_offset) {
  const int world = static_cast<int>(ranks.size());
  auto state = std::make_unique<State>();
  state->lease = lease;
  state->config = config;
  state->allocator = std::move(allocator);
  state->rank = rank;
  state->num_ranks = world;
  state->experts_per_rank = config.num_experts / world;
  internal::DataPathConfig path{.config = config,
                                .rank = state->rank,
                                .num_ranks = world,
                                .experts_per_rank = state->experts_per_rank,
                                .allocator = state->allocator};
  bool group_order = true;  // the inner path of a group across hosts indexes this host's ranks, not the group's
  for (int r = 0; r < world; ++r) {
    path.peer_regions[r] = static_cast<char*>(lease->region(ranks[r])) + region_offset;
    group_order = group_order && ranks[r] == r;
  }
  // The inner stage of a group across hosts (its ranks are this host's, by index): the words in that order.
  const bool same_host_order = !group_order && ranks == lease->nvl_ranks();
  if (group_order || same_host_order) {
    path.lost_ranks = lease->lost_ranks_words(lease->backend() == v1::BACKEND_CUDA, same_host_order);
    path.lost_ranks_host = lease->lost_ranks_words(/*device=*/false, same_host_order);
  }
  EPF_ASSIGN_OR_RETURN(state->path, internal::DataPath::Create(lease->backend(), path));
  return std::unique_ptr<Buffer>(new Buffer(std::move(state)));
}

// A group that spans hosts (internode_path.h): an inner Buffer over this host's ranks, the outer one for the layout.
// In a group that serves both modes, normal mode has the first `nvl_limit` / `rdma_limit` bytes of the regions.
absl::StatusOr<std::unique_ptr<Buffer>> Buffer::CreateInternode(Lease* lease, const BufferConfig& config,
                                                                std::shared_ptr<Allocator> allocator,
                                                                uint64_t nvl_limit, uint64_t rdma_limit) {
  EPF_ASSIGN_OR_RETURN(const internal::InternodeGroupShape shape, internal::InternodeShapeOf(*lease));
  EPF_ASSIGN_OR_RETURN(const GroupBytes bytes, RequiredGroupBytes(config, shape.num_hosts, shape.ranks_per_host));
  const BufferConfig inner_config = internal::InnerBufferConfig(config, shape);
  EPF_RETURN_IF_ERROR(
      CheckRegions(*lease, inner_config, lease->nvl_ranks(), bytes.nvl,
                   {.limit = nvl_limit, .name = nvl_limit == UINT64_MAX ? "region" : "normal-mode part"}));
  allocator = allocator != nullptr ? std::move(allocator) : DefaultAllocator(lease->backend());
  EPF_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> inner,
                       CreateOver(lease, inner_config, shape.local_rank, lease->nvl_ranks(), allocator));

  const int world = lease->world_size();
  auto state = std::make_unique<State>();
  state->lease = lease;
  state->config = config;
  state->allocator = allocator;
  state->rank = lease->rank();
  state->num_ranks = world;
  state->experts_per_rank = config.num_experts / world;
  internal::DataPathConfig outer{.config = config,
                                 .rank = state->rank,
                                 .num_ranks = world,
                                 .experts_per_rank = state->experts_per_rank,
                                 .allocator = allocator,
                                 .layout_only = true};
  EPF_ASSIGN_OR_RETURN(state->path, internal::DataPath::Create(lease->backend(), outer));
  internal::DataPath* inner_path = inner->state_->path.get();
  EPF_ASSIGN_OR_RETURN(state->internode, internal::InternodePath::Create(lease, config, shape, std::move(inner),
                                                                         inner_path, std::move(allocator), rdma_limit));
  auto buffer = std::unique_ptr<Buffer>(new Buffer(std::move(state)));
  EPF_RETURN_IF_ERROR(buffer->CountInto(lease));
  return buffer;
}

namespace {

// BufferConfig::low_latency_issue resolved for this lease (decision 84).
absl::StatusOr<bool> IssuesFromTheDevice(const Lease& lease, const BufferConfig& config) {
  using Issue = BufferConfig::LowLatencyIssue;
  Issue issue = config.low_latency_issue;
  const bool cuda = lease.backend() == v1::BACKEND_CUDA;
  if (issue == Issue::kDevice && !cuda) {
    return absl::InvalidArgumentError(
        "low_latency_issue = device needs a cuda group (the host backend sends each write as it is made)");
  }
  if (issue == Issue::kAuto) {
    const char* env = std::getenv("EPF_LOW_LATENCY_ISSUE");
    const std::string choice = env != nullptr ? env : "";
    if (!choice.empty() && choice != "auto" && choice != "device" && choice != "relay") {
      return absl::InvalidArgumentError(
          absl::StrCat("EPF_LOW_LATENCY_ISSUE='", choice, "': expected device, relay or auto"));
    }
    // A valid choice applies to cuda groups: the host backend has none to make.
    if (cuda && choice == "device") issue = Issue::kDevice;
    if (cuda && choice == "relay") issue = Issue::kRelay;
  }
  if (issue == Issue::kAuto) return cuda && lease.transport() == v1::TRANSPORT_VERBS;
  return issue == Issue::kDevice;
}

}  // namespace

// Low latency across hosts (internode_low_latency.h): the low-latency path over all ranks, the ranks on other hosts
// reached through the transport (host backend: sent as written; cuda: put by an issue kernel after each step, or
// relayed by the calling thread between steps, IssuesFromTheDevice).
// In a group that serves both modes, low latency has the regions from `nvl_offset` / `rdma_offset` on.
absl::StatusOr<std::unique_ptr<Buffer>> Buffer::CreateLowLatencyInternode(Lease* lease, const BufferConfig& config,
                                                                          std::shared_ptr<Allocator> allocator,
                                                                          uint64_t nvl_offset, uint64_t rdma_offset) {
  const int world = lease->world_size();
  if (world > kernels::kMaxLowLatencyRanks) {
    return InvalidValue(
        "world_size", world,
        absl::StrCat("at most ", kernels::kMaxLowLatencyRanks, " ranks in low-latency mode across hosts"));
  }
  EPF_ASSIGN_OR_RETURN(const internal::InternodeGroupShape shape, internal::InternodeShapeOf(*lease));
  EPF_ASSIGN_OR_RETURN(const GroupBytes bytes, RequiredGroupBytes(config, shape.num_hosts, shape.ranks_per_host));
  EPF_RETURN_IF_ERROR(CheckRegions(*lease, config, lease->nvl_ranks(), bytes.nvl,
                                   {.offset = nvl_offset, .name = nvl_offset == 0 ? "region" : "low-latency part"}));
  EPF_ASSIGN_OR_RETURN(
      const kernels::LowLatencyLayout layout,
      kernels::MakeLowLatencyLayout(config.max_tokens_per_rank, config.hidden, world, config.num_experts));
  EPF_ASSIGN_OR_RETURN(auto remote, internal::LowLatencyRemote::Create(lease, layout, config.timeout, rdma_offset));
  auto state = std::make_unique<State>();
  state->lease = lease;
  state->config = config;
  state->allocator = allocator != nullptr ? std::move(allocator) : DefaultAllocator(lease->backend());
  state->rank = lease->rank();
  state->num_ranks = world;
  state->experts_per_rank = config.num_experts / world;
  internal::DataPathConfig path{.config = config,
                                .rank = state->rank,
                                .num_ranks = world,
                                .experts_per_rank = state->experts_per_rank,
                                .allocator = state->allocator};
  for (int r = 0; r < world; ++r) {
    // Ranks on other hosts have no mapped region: remote->Configure gives them their staging copies.
    if (lease->region(r) != nullptr) path.peer_regions[r] = static_cast<char*>(lease->region(r)) + nvl_offset;
  }
  const bool cuda = lease->backend() == v1::BACKEND_CUDA;
  path.lost_ranks = lease->lost_ranks_words(/*device=*/cuda);
  path.lost_ranks_host = lease->lost_ranks_words(/*device=*/false);
  remote->Configure(&path);
  EPF_ASSIGN_OR_RETURN(const bool device_issue, IssuesFromTheDevice(*lease, config));
  const bool relay = (cuda && !device_issue) || config.low_latency_relay;
  if (relay || device_issue) path.remote_put = nullptr;  // the relay or the issue kernel sends what the steps staged
  EPF_ASSIGN_OR_RETURN(auto inner_path, internal::DataPath::Create(lease->backend(), path));
  if (device_issue) {
    EPF_ASSIGN_OR_RETURN(state->path, internal::NewLowLatencyDevicePath(std::move(inner_path), std::move(remote), lease,
                                                                        config.timeout));
  } else if (relay) {
    // The cuda kernels cannot send over the transport themselves: the calling thread relays between steps.
    EPF_ASSIGN_OR_RETURN(state->path, internal::NewLowLatencyRelayPath(std::move(inner_path), std::move(remote), layout,
                                                                       state->rank, path.peer_regions[state->rank],
                                                                       path.lost_ranks_host, config.timeout));
  } else {
    EPF_ASSIGN_OR_RETURN(state->path, internal::NewLowLatencyInternodePath(std::move(inner_path), std::move(remote)));
  }
  auto buffer = std::unique_ptr<Buffer>(new Buffer(std::move(state)));
  EPF_RETURN_IF_ERROR(buffer->CountInto(lease));
  return buffer;
}

TensorView Buffer::NextLowLatencyCombineBuffer() const {
  const State& s = *state_;
  if (!s.config.low_latency) return {};
  return TensorView{
      s.path->LowLatencyCombineInputBuffer(),
      DType::kBF16,
      {s.experts_per_rank, static_cast<int64_t>(s.num_ranks) * s.config.max_tokens_per_rank, s.config.hidden}};
}

TensorView Buffer::LowLatencyRankMask() const {
  const State& s = *state_;
  int32_t* mask = s.config.low_latency ? s.path->LowLatencyRankMask() : nullptr;
  if (mask == nullptr) return {};
  return TensorView{mask, DType::kInt32, {s.num_ranks}};
}

absl::Status Buffer::Check(cudaStream_t stream) {
  State& s = *state_;
  if (s.stats != nullptr) (void)s.stats->Publish(stream);  // counters only: never fails the check
  absl::Status status = s.internode != nullptr ? s.internode->Check(stream) : s.path->Check(stream);
  if (s.stats != nullptr) s.stats->Failure(status);
  return s.config.low_latency ? s.ExplainFirstCall(std::move(status)) : status;
}

absl::Status Buffer::Reset(cudaStream_t stream) {
  State& s = *state_;
  s.recv_hook_pending = false;
  s.cursor = kernels::LowLatencyBufferCursor();
  s.generation_pending = true;
  if (s.internode != nullptr) return s.internode->Reset(stream);
  return s.path->Reset(stream);
}

}  // namespace epfabric::client
