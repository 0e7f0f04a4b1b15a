// The C ABI of epfabric.h over the C++ client and Buffer: conversions, the allocator bridge, error reporting. Every
// entry point catches nothing (the C++ API does not throw) and reports failures as a status code plus a thread-local
// message.
#include "epfabric/epfabric.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"

struct epf_client {
  std::unique_ptr<epfabric::client::Client> client;
};
struct epf_lease {
  std::unique_ptr<epfabric::client::Lease> lease;
};
struct epf_buffer {
  std::unique_ptr<epfabric::client::Buffer> buffer;
  // Expires when the Buffer is destroyed: its hooks hold a weak reference and refuse to run after that (a hook runs
  // on the Buffer's state; handles own everything they free and need no such check).
  std::shared_ptr<const bool> alive = std::make_shared<const bool>(true);
};
struct epf_dispatch_handle {
  std::shared_ptr<const epfabric::client::DispatchHandle> handle;
};
struct epf_ll_handle {
  std::shared_ptr<const epfabric::client::LowLatencyHandle> handle;
  int num_tokens = 0;
};
struct epf_layout_keep {
  epfabric::client::Tensor num_invalid_topk;
};
struct epf_hook {
  std::function<absl::Status(cudaStream_t)> run;
  std::weak_ptr<const bool> buffer_alive;  // epf_buffer::alive of the Buffer whose call made it
};

namespace {

using epfabric::client::Tensor;
using epfabric::client::TensorView;
using epfabric::kernels::DType;

thread_local std::string last_error;

epf_status Fail(const absl::Status& status) {
  last_error = std::string(status.message());
  return static_cast<epf_status>(status.code());
}

epf_status Report(const absl::Status& status) {
  if (status.ok()) {
    last_error.clear();
    return EPF_OK;
  }
  return Fail(status);
}

absl::Status Null(const char* what) { return absl::InvalidArgumentError(absl::StrCat(what, " is null")); }

absl::StatusOr<TensorView> ToView(const epf_tensor& t, const char* name) {
  TensorView v;
  if (t.ndim == 0 && t.data == nullptr) return v;  // not given
  if (t.ndim < 0 || t.ndim > EPF_MAX_DIMS) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".ndim = ", t.ndim, ": must be in [0, ", EPF_MAX_DIMS, "]"));
  }
  if (t.dtype < EPF_BF16 || t.dtype > EPF_BOOL) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".dtype = ", t.dtype, ": not an epfabric dtype"));
  }
  v.data = t.data;
  v.dtype = static_cast<DType>(t.dtype);
  v.shape.assign(t.shape, t.shape + t.ndim);
  return v;
}

epf_tensor FromView(const TensorView& v) {
  epf_tensor t{};
  t.data = v.data;
  t.dtype = static_cast<int32_t>(v.dtype);
  t.ndim = static_cast<int32_t>(std::min<size_t>(v.shape.size(), EPF_MAX_DIMS));
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = v.shape[i];
  return t;
}

// Outputs come from the caller's allocator: a framework binding hands out its own tensors.
class CallbackAllocator final : public epfabric::client::Allocator {
 public:
  CallbackAllocator(epf_alloc_fn alloc, epf_free_fn free_fn, void* ctx, epf_alloc_tensor_fn alloc_tensor = nullptr)
      : alloc_(alloc), free_(free_fn), ctx_(ctx), alloc_tensor_(alloc_tensor) {}
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t stream) override {
    void* ptr = alloc_ != nullptr ? alloc_(ctx_, bytes, stream) : nullptr;
    if (ptr == nullptr)
      return absl::ResourceExhaustedError(absl::StrCat("the allocator returned no memory for ", bytes, " bytes"));
    return ptr;
  }
  absl::StatusOr<void*> AllocateTensor(DType dtype, const std::vector<int64_t>& shape, size_t bytes,
                                       cudaStream_t stream) override {
    if (alloc_tensor_ == nullptr || shape.size() > EPF_MAX_DIMS) {
      return Allocator::AllocateTensor(dtype, shape, bytes, stream);
    }
    void* ptr = alloc_tensor_(ctx_, static_cast<int32_t>(dtype), static_cast<int32_t>(shape.size()), shape.data(),
                              bytes, stream);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("the allocator returned no memory for a ",
                                                       epfabric::kernels::DTypeName(dtype), " tensor of ", bytes,
                                                       " bytes"));
    }
    return ptr;
  }
  void Free(void* ptr, cudaStream_t stream) override {
    if (free_ != nullptr) free_(ctx_, ptr, stream);
  }

 private:
  epf_alloc_fn alloc_;
  epf_free_fn free_;
  void* ctx_;
  epf_alloc_tensor_fn alloc_tensor_;
};

cudaStream_t Stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Whether an options struct of the caller's size (struct_size) holds `field`: older callers pass shorter structs.
template <typename Options, typename Field>
bool HasOption(const Options* options, Field Options::*field) {
  if (options == nullptr) return false;
  const size_t end =
      static_cast<size_t>(reinterpret_cast<const char*>(&(options->*field)) - reinterpret_cast<const char*>(options)) +
      sizeof(Field);
  return options->struct_size >= end;
}

// The wait-cost statistics of epf_ll_options, when the caller's struct has them.
absl::StatusOr<TensorView> WaitCostStats(const epf_ll_options* options) {
  if (!HasOption(options, &epf_ll_options::wait_recv_cost_stats)) return TensorView{};
  return ToView(options->wait_recv_cost_stats, "wait_recv_cost_stats");
}

}  // namespace

extern "C" {

const char* epf_version(void) { return EPF_VERSION; }
int epf_abi_version(void) { return EPF_ABI_VERSION; }
int epf_abi_minor_version(void) { return EPF_ABI_MINOR_VERSION; }
const char* epf_last_error(void) { return last_error.c_str(); }

// ---- control ----

epf_status epf_client_connect(const char* socket_path, const char* client_name, double timeout_s, epf_client** out) {
  if (socket_path == nullptr || out == nullptr) return Fail(Null("socket_path or out"));
  epfabric::client::ConnectOptions options;
  if (timeout_s > 0) options.timeout = absl::Seconds(timeout_s);
  if (client_name != nullptr) options.client_name = client_name;
  auto client = epfabric::client::Client::Connect(socket_path, options);
  if (!client.ok()) return Fail(client.status());
  *out = new epf_client{std::move(*client)};
  return Report(absl::OkStatus());
}

void epf_client_destroy(epf_client* client) { delete client; }

epf_status epf_client_daemon_info(epf_client* client, int32_t* fabric_rank, int32_t* world_size, int32_t* backend,
                                  int32_t* device) {
  if (client == nullptr || fabric_rank == nullptr || world_size == nullptr || backend == nullptr || device == nullptr) {
    return Fail(Null("client or outputs"));
  }
  auto info = client->client->GetDaemonInfo();
  if (!info.ok()) return Fail(info.status());
  *fabric_rank = info->rank();
  *world_size = info->world_size();
  *backend = static_cast<int32_t>(info->backend());
  *device = info->device();
  return Report(absl::OkStatus());
}

epf_status epf_client_host_id(epf_client* client, char* out, size_t capacity) {
  if (client == nullptr || out == nullptr) return Fail(Null("client or out"));
  auto topology = client->client->GetTopology();
  if (!topology.ok()) return Fail(topology.status());
  const std::string& host = topology->host_id();
  if (host.size() + 1 > capacity) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("capacity = ", capacity, ": the host id needs ", host.size() + 1, " bytes")));
  }
  std::memcpy(out, host.c_str(), host.size() + 1);
  return Report(absl::OkStatus());
}

epf_status epf_create_group(epf_client* client, const char* name, const int32_t* ranks, int num_ranks,
                            uint64_t num_nvl_bytes, uint64_t num_rdma_bytes, int low_latency, char* token_out,
                            size_t token_capacity) {
  return epf_create_group_ex(client, name, ranks, num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency, 0, token_out,
                             token_capacity);
}

epf_status epf_create_group_ex(epf_client* client, const char* name, const int32_t* ranks, int num_ranks,
                               uint64_t num_nvl_bytes, uint64_t num_rdma_bytes, int low_latency,
                               uint64_t num_normal_bytes, char* token_out, size_t token_capacity) {
  epf_group_options options{};
  options.struct_size = sizeof(options);
  options.num_normal_bytes = num_normal_bytes;
  return epf_create_group_opts(client, name, ranks, num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency, &options,
                               token_out, token_capacity);
}

// What epfabric.h promises a token fits in.
constexpr size_t kTokenBufferBytes = 65;

epf_status epf_create_group_opts(epf_client* client, const char* name, const int32_t* ranks, int num_ranks,
                                 uint64_t num_nvl_bytes, uint64_t num_rdma_bytes, int low_latency,
                                 const epf_group_options* options, char* token_out, size_t token_capacity) {
  if (client == nullptr || name == nullptr || ranks == nullptr || token_out == nullptr) {
    return Fail(Null("client, name, ranks or token_out"));
  }
  if (num_ranks < 0) return Fail(absl::InvalidArgumentError(absl::StrCat("num_ranks = ", num_ranks)));
  // Checked before the group exists: a group whose token the caller never gets could not be used or deleted.
  if (token_capacity < kTokenBufferBytes) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("token_capacity = ", token_capacity, ": at least ",
                                                        kTokenBufferBytes, " bytes; no group was created")));
  }
  epfabric::v1::CreateGroupRequest request;
  request.set_name(name);
  for (int i = 0; i < num_ranks; ++i) request.add_ranks(ranks[i]);
  request.set_num_nvl_bytes(num_nvl_bytes);
  request.set_num_rdma_bytes(num_rdma_bytes);
  request.set_low_latency(low_latency != 0);
  if (HasOption(options, &epf_group_options::num_normal_bytes)) request.set_num_normal_bytes(options->num_normal_bytes);
  if (HasOption(options, &epf_group_options::num_normal_rdma_bytes)) {
    request.set_num_normal_rdma_bytes(options->num_normal_rdma_bytes);
  }
  if (HasOption(options, &epf_group_options::transport_channels)) {
    request.set_transport_channels(options->transport_channels);
  }
  if (HasOption(options, &epf_group_options::ring_slots)) request.set_ring_slots(options->ring_slots);
  auto created = client->client->CreateGroup(request);
  if (!created.ok()) return Fail(created.status());
  if (created->token().size() + 1 > token_capacity) {
    // Not with a daemon of this version (tokens are 32 characters); a group nobody can use is deleted again.
    (void)client->client->DeleteGroup(name, created->token());
    return Fail(absl::InvalidArgumentError(absl::StrCat("token_capacity = ", token_capacity, ": the token needs ",
                                                        created->token().size() + 1, "; the group was deleted")));
  }
  std::memcpy(token_out, created->token().c_str(), created->token().size() + 1);
  return Report(absl::OkStatus());
}

epf_status epf_delete_group(epf_client* client, const char* name, const char* token) {
  if (client == nullptr || name == nullptr || token == nullptr) return Fail(Null("client, name or token"));
  return Report(client->client->DeleteGroup(name, token));
}

epf_status epf_attach(epf_client* client, const char* group, int rank, const char* token, int accessing_device,
                      epf_lease** out) {
  if (client == nullptr || group == nullptr || token == nullptr || out == nullptr) {
    return Fail(Null("client, group, token or out"));
  }
  epfabric::client::AttachOptions options;
  options.accessing_device = accessing_device;
  auto lease = client->client->Attach(group, rank, token, options);
  if (!lease.ok()) return Fail(lease.status());
  *out = new epf_lease{std::move(*lease)};
  return Report(absl::OkStatus());
}

epf_status epf_lease_detach(epf_lease* lease) {
  if (lease == nullptr) return Fail(Null("lease"));
  return Report(lease->lease->Detach());
}
void epf_lease_destroy(epf_lease* lease) { delete lease; }
int epf_lease_rank(const epf_lease* lease) { return lease->lease->rank(); }
int epf_lease_world_size(const epf_lease* lease) { return lease->lease->world_size(); }
int epf_lease_backend(const epf_lease* lease) { return static_cast<int>(lease->lease->backend()); }
int epf_lease_low_latency(const epf_lease* lease) { return lease->lease->group().low_latency() ? 1 : 0; }
uint64_t epf_lease_num_normal_bytes(const epf_lease* lease) { return lease->lease->group().num_normal_bytes(); }
uint64_t epf_lease_num_normal_rdma_bytes(const epf_lease* lease) {
  return lease->lease->group().num_normal_rdma_bytes();
}
epf_status epf_lease_group_bytes(const epf_lease* lease, uint64_t* nvl_bytes, uint64_t* rdma_bytes) {
  if (lease == nullptr || nvl_bytes == nullptr || rdma_bytes == nullptr) return Fail(Null("lease or outputs"));
  *nvl_bytes = lease->lease->group().num_nvl_bytes();
  *rdma_bytes = lease->lease->group().num_rdma_bytes();
  return Report(absl::OkStatus());
}
int epf_lease_num_nvl_ranks(const epf_lease* lease) { return static_cast<int>(lease->lease->nvl_ranks().size()); }
epf_status epf_lease_healthy(const epf_lease* lease) { return Report(lease->lease->Healthy()); }

epf_status epf_lease_region(const epf_lease* lease, int rdma, void** data, uint64_t* bytes) {
  if (lease == nullptr || data == nullptr || bytes == nullptr) return Fail(Null("lease, data or bytes"));
  const epfabric::client::Lease& l = *lease->lease;
  *data = rdma != 0 ? l.rdma_region() : l.region(l.rank());
  *bytes = rdma != 0 ? l.rdma_region_bytes() : l.region_bytes(l.rank());
  if (*data == nullptr) {
    return Fail(absl::FailedPreconditionError(rdma != 0 ? "the group has no RDMA region (num_rdma_bytes = 0)"
                                                        : "this rank's region is not mapped"));
  }
  return Report(absl::OkStatus());
}

// ---- buffer ----

static epfabric::client::BufferConfig ToConfig(const epf_buffer_config& c) {
  epfabric::client::BufferConfig config;
  config.max_tokens_per_rank = c.max_tokens_per_rank;
  config.hidden = c.hidden;
  config.max_topk = c.max_topk;
  config.num_experts = c.num_experts;
  if (c.num_sms > 0) config.num_sms = c.num_sms;
  config.low_latency = c.low_latency != 0;
  if (c.timeout_s > 0) config.timeout = absl::Seconds(c.timeout_s);
  config.low_latency_sms = c.low_latency_sms;
  return config;
}

epf_status epf_required_group_bytes(const epf_buffer_config* config, int num_hosts, int ranks_per_host,
                                    uint64_t* nvl_bytes, uint64_t* rdma_bytes) {
  if (config == nullptr || nvl_bytes == nullptr || rdma_bytes == nullptr) return Fail(Null("config or outputs"));
  auto bytes = epfabric::client::RequiredGroupBytes(ToConfig(*config), num_hosts, ranks_per_host);
  if (!bytes.ok()) return Fail(bytes.status());
  *nvl_bytes = bytes->nvl;
  *rdma_bytes = bytes->rdma;
  return Report(absl::OkStatus());
}

epf_status epf_buffer_create(epf_lease* lease, const epf_buffer_config* config, epf_alloc_fn alloc, epf_free_fn free_fn,
                             void* alloc_ctx, epf_buffer** out) {
  if (lease == nullptr || config == nullptr || out == nullptr) return Fail(Null("lease, config or out"));
  std::shared_ptr<epfabric::client::Allocator> allocator;
  if (alloc != nullptr) allocator = std::make_shared<CallbackAllocator>(alloc, free_fn, alloc_ctx);
  auto buffer = epfabric::client::Buffer::Create(lease->lease.get(), ToConfig(*config), std::move(allocator));
  if (!buffer.ok()) return Fail(buffer.status());
  *out = new epf_buffer{std::move(*buffer)};
  return Report(absl::OkStatus());
}

epf_status epf_buffer_create_ex(epf_lease* lease, const epf_buffer_config* config, const epf_allocator* allocator,
                                epf_buffer** out) {
  return epf_buffer_create_opts(lease, config, allocator, nullptr, out);
}

epf_status epf_buffer_create_opts(epf_lease* lease, const epf_buffer_config* config, const epf_allocator* allocator,
                                  const epf_buffer_options* options, epf_buffer** out) {
  if (lease == nullptr || config == nullptr || out == nullptr) return Fail(Null("lease, config or out"));
  epfabric::client::BufferConfig buffer_config = ToConfig(*config);
  if (HasOption(options, &epf_buffer_options::low_latency_issue)) {
    using Issue = epfabric::client::BufferConfig::LowLatencyIssue;
    switch (options->low_latency_issue) {
      case EPF_LL_ISSUE_AUTO:
        buffer_config.low_latency_issue = Issue::kAuto;
        break;
      case EPF_LL_ISSUE_RELAY:
        buffer_config.low_latency_issue = Issue::kRelay;
        break;
      case EPF_LL_ISSUE_DEVICE:
        buffer_config.low_latency_issue = Issue::kDevice;
        break;
      default:
        return Fail(absl::InvalidArgumentError(absl::StrCat("options->low_latency_issue = ", options->low_latency_issue,
                                                            ": expected EPF_LL_ISSUE_AUTO, _RELAY or _DEVICE")));
    }
  }
  if (HasOption(options, &epf_buffer_options::enable_shrink)) buffer_config.enable_shrink = options->enable_shrink != 0;
  std::shared_ptr<epfabric::client::Allocator> callbacks;
  if (allocator != nullptr) {
    if (allocator->struct_size < offsetof(epf_allocator, alloc_tensor)) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("allocator->struct_size = ", allocator->struct_size, ": too small for epf_allocator")));
    }
    const epf_alloc_tensor_fn alloc_tensor =
        HasOption(allocator, &epf_allocator::alloc_tensor) ? allocator->alloc_tensor : nullptr;
    if (allocator->alloc != nullptr || alloc_tensor != nullptr) {
      callbacks =
          std::make_shared<CallbackAllocator>(allocator->alloc, allocator->free_fn, allocator->ctx, alloc_tensor);
    }
  }
  auto buffer = epfabric::client::Buffer::Create(lease->lease.get(), buffer_config, std::move(callbacks));
  if (!buffer.ok()) return Fail(buffer.status());
  *out = new epf_buffer{std::move(*buffer)};
  return Report(absl::OkStatus());
}

void epf_buffer_destroy(epf_buffer* buffer) { delete buffer; }
int epf_buffer_rank(const epf_buffer* buffer) { return buffer->buffer->rank(); }
int epf_buffer_num_ranks(const epf_buffer* buffer) { return buffer->buffer->num_ranks(); }
epf_status epf_buffer_check(epf_buffer* buffer, void* stream) { return Report(buffer->buffer->Check(Stream(stream))); }
epf_status epf_buffer_reset(epf_buffer* buffer, void* stream) { return Report(buffer->buffer->Reset(Stream(stream))); }

// ---- normal mode ----

epf_status epf_get_dispatch_layout(epf_buffer* buffer, const epf_tensor* topk_idx, void* stream, epf_layout* out) {
  if (buffer == nullptr || topk_idx == nullptr || out == nullptr) return Fail(Null("buffer, topk_idx or out"));
  auto idx = ToView(*topk_idx, "topk_idx");
  if (!idx.ok()) return Fail(idx.status());
  auto layout = buffer->buffer->GetDispatchLayout(*idx, Stream(stream));
  if (!layout.ok()) return Fail(layout.status());
  out->num_tokens_per_rank = FromView(layout->num_tokens_per_rank.view);
  out->num_tokens_per_expert = FromView(layout->num_tokens_per_expert.view);
  out->is_token_in_rank = FromView(layout->is_token_in_rank.view);
  out->num_invalid_topk = FromView(layout->num_invalid_topk.view);
  out->keep = new epf_layout_keep{std::move(layout->num_invalid_topk)};
  return Report(absl::OkStatus());
}

void epf_layout_release(epf_layout* layout) {
  if (layout == nullptr) return;
  delete layout->keep;
  layout->keep = nullptr;
}

epf_status epf_dispatch(epf_buffer* buffer, const epf_dispatch_args* args, void* stream, epf_dispatch_result* out) {
  return epf_dispatch_ex(buffer, args, nullptr, stream, out);
}

epf_status epf_dispatch_ex(epf_buffer* buffer, const epf_dispatch_args* args, const epf_dispatch_options* options,
                           void* stream, epf_dispatch_result* out) {
  if (buffer == nullptr || args == nullptr || out == nullptr) return Fail(Null("buffer, args or out"));
  epfabric::client::DispatchArgs a;
  epfabric::client::DispatchLayout layout;
  for (auto [src, dst, name] : {std::tuple{&args->x, &a.x, "x"}, std::tuple{&args->x_scales, &a.x_scales, "x_scales"},
                                std::tuple{&args->topk_idx, &a.topk_idx, "topk_idx"},
                                std::tuple{&args->topk_weights, &a.topk_weights, "topk_weights"}}) {
    auto view = ToView(*src, name);
    if (!view.ok()) return Fail(view.status());
    *dst = *view;
  }
  if (args->layout != nullptr) {
    for (auto [src, dst, name] :
         {std::tuple{&args->layout->num_tokens_per_rank, &layout.num_tokens_per_rank, "layout.num_tokens_per_rank"},
          std::tuple{&args->layout->num_tokens_per_expert, &layout.num_tokens_per_expert,
                     "layout.num_tokens_per_expert"},
          std::tuple{&args->layout->is_token_in_rank, &layout.is_token_in_rank, "layout.is_token_in_rank"},
          std::tuple{&args->layout->num_invalid_topk, &layout.num_invalid_topk, "layout.num_invalid_topk"}}) {
      auto view = ToView(*src, name);
      if (!view.ok()) return Fail(view.status());
      dst->view = *view;
    }
    a.layout = &layout;
  }
  if (args->cached != nullptr) a.cached = args->cached->handle;
  a.expert_alignment = args->expert_alignment > 0 ? args->expert_alignment : 1;
  if (HasOption(options, &epf_dispatch_options::num_worst_tokens)) a.num_worst_tokens = options->num_worst_tokens;
  auto result = buffer->buffer->Dispatch(a, Stream(stream));
  if (!result.ok()) return Fail(result.status());
  out->recv_x = FromView(result->recv_x.view);
  out->recv_x_scales = FromView(result->recv_x_scales.view);
  out->recv_topk_idx = FromView(result->recv_topk_idx.view);
  out->recv_topk_weights = FromView(result->recv_topk_weights.view);
  out->num_recv_tokens = result->handle->num_recv_tokens;
  out->num_local_experts = static_cast<int32_t>(result->num_recv_tokens_per_expert.size());
  if (out->num_recv_tokens_per_expert != nullptr) {
    const size_t n =
        std::min<size_t>(result->num_recv_tokens_per_expert.size(), std::max(out->num_local_experts_capacity, 0));
    // std::copy_n, not memcpy: the vector is empty (its data() may be null) when nothing was counted.
    std::copy_n(result->num_recv_tokens_per_expert.begin(), n, out->num_recv_tokens_per_expert);
  }
  out->handle = new epf_dispatch_handle{std::move(result->handle)};
  return Report(absl::OkStatus());
}

void epf_dispatch_handle_destroy(epf_dispatch_handle* handle) { delete handle; }
int epf_dispatch_handle_num_recv_tokens(const epf_dispatch_handle* handle) { return handle->handle->num_recv_tokens; }
int epf_dispatch_handle_num_tokens(const epf_dispatch_handle* handle) { return handle->handle->num_tokens; }

epf_status epf_dispatch_handle_rank_prefix_matrix(const epf_dispatch_handle* handle, epf_tensor* out) {
  if (handle == nullptr || out == nullptr) return Fail(Null("handle or out"));
  // Across hosts the handle's rank_prefix_matrix is the NVLink stage's (ranks of one host), not DeepEP's.
  *out = handle->handle->internode != nullptr ? epf_tensor{} : FromView(handle->handle->rank_prefix_matrix.view);
  return Report(absl::OkStatus());
}

epf_status epf_combine(epf_buffer* buffer, const epf_combine_args* args, void* stream, epf_combine_result* out) {
  if (buffer == nullptr || args == nullptr || out == nullptr) return Fail(Null("buffer, args or out"));
  if (args->handle == nullptr) return Fail(Null("handle"));
  epfabric::client::CombineArgs a;
  for (auto [src, dst, name] :
       {std::tuple{&args->x, &a.x, "x"}, std::tuple{&args->topk_weights, &a.topk_weights, "topk_weights"},
        std::tuple{&args->bias_0, &a.bias_0, "bias_0"}, std::tuple{&args->bias_1, &a.bias_1, "bias_1"}}) {
    auto view = ToView(*src, name);
    if (!view.ok()) return Fail(view.status());
    *dst = *view;
  }
  a.handle = args->handle->handle;
  auto result = buffer->buffer->Combine(a, Stream(stream));
  if (!result.ok()) return Fail(result.status());
  out->combined_x = FromView(result->combined_x.view);
  out->combined_topk_weights = FromView(result->combined_topk_weights.view);
  return Report(absl::OkStatus());
}

// ---- low-latency mode ----

epf_status epf_low_latency_dispatch(epf_buffer* buffer, const epf_ll_dispatch_args* args, void* stream,
                                    epf_ll_dispatch_result* out) {
  return epf_low_latency_dispatch_ex(buffer, args, nullptr, stream, out);
}

epf_status epf_low_latency_dispatch_ex(epf_buffer* buffer, const epf_ll_dispatch_args* args,
                                       const epf_ll_options* options, void* stream, epf_ll_dispatch_result* out) {
  if (buffer == nullptr || args == nullptr || out == nullptr) return Fail(Null("buffer, args or out"));
  epfabric::client::LowLatencyDispatchArgs a;
  for (auto [src, dst, name] : {std::tuple{&args->x, &a.x, "x"}, std::tuple{&args->topk_idx, &a.topk_idx, "topk_idx"},
                                std::tuple{&args->cumulative_stats, &a.cumulative_stats, "cumulative_stats"}}) {
    auto view = ToView(*src, name);
    if (!view.ok()) return Fail(view.status());
    *dst = *view;
  }
  a.use_fp8 = args->use_fp8 != 0;
  a.round_scale = args->round_scale != 0;
  a.use_ue8m0 = args->use_ue8m0 != 0;
  a.return_recv_hook = args->return_recv_hook != 0;
  auto wait_cost = WaitCostStats(options);
  if (!wait_cost.ok()) return Fail(wait_cost.status());
  a.wait_recv_cost_stats = *wait_cost;
  auto result = buffer->buffer->LowLatencyDispatch(a, Stream(stream));
  if (!result.ok()) return Fail(result.status());
  out->packed_recv_x = FromView(result->packed_recv_x.view);
  out->packed_recv_x_scales = FromView(result->packed_recv_x_scales.view);
  out->packed_recv_count = FromView(result->packed_recv_count.view);
  out->packed_recv_src_info = FromView(result->packed_recv_src_info.view);
  out->packed_recv_layout_range = FromView(result->packed_recv_layout_range.view);
  out->handle = new epf_ll_handle{std::move(result->handle), static_cast<int>(a.x.shape.empty() ? 0 : a.x.shape[0])};
  out->hook = result->recv_hook ? new epf_hook{std::move(result->recv_hook), buffer->alive} : nullptr;
  return Report(absl::OkStatus());
}

void epf_ll_handle_destroy(epf_ll_handle* handle) { delete handle; }

epf_status epf_low_latency_combine(epf_buffer* buffer, const epf_ll_combine_args* args, void* stream,
                                   epf_ll_combine_result* out) {
  return epf_low_latency_combine_ex(buffer, args, nullptr, stream, out);
}

epf_status epf_low_latency_combine_ex(epf_buffer* buffer, const epf_ll_combine_args* args,
                                      const epf_ll_options* options, void* stream, epf_ll_combine_result* out) {
  if (buffer == nullptr || args == nullptr || out == nullptr) return Fail(Null("buffer, args or out"));
  if (args->handle == nullptr) return Fail(Null("handle"));
  epfabric::client::LowLatencyCombineArgs a;
  for (auto [src, dst, name] :
       {std::tuple{&args->x, &a.x, "x"}, std::tuple{&args->topk_idx, &a.topk_idx, "topk_idx"},
        std::tuple{&args->topk_weights, &a.topk_weights, "topk_weights"}, std::tuple{&args->out, &a.out, "out"}}) {
    auto view = ToView(*src, name);
    if (!view.ok()) return Fail(view.status());
    *dst = *view;
  }
  a.handle = args->handle->handle;
  a.zero_copy = args->zero_copy != 0;
  a.return_recv_hook = args->return_recv_hook != 0;
  auto wait_cost = WaitCostStats(options);
  if (!wait_cost.ok()) return Fail(wait_cost.status());
  a.wait_recv_cost_stats = *wait_cost;
  auto result = buffer->buffer->LowLatencyCombine(a, Stream(stream));
  if (!result.ok()) return Fail(result.status());
  out->combined_x = FromView(result->combined_x.view);
  out->hook = result->recv_hook ? new epf_hook{std::move(result->recv_hook), buffer->alive} : nullptr;
  return Report(absl::OkStatus());
}

epf_status epf_hook_run(epf_hook* hook, void* stream) {
  if (hook == nullptr) return Fail(Null("hook"));
  if (!hook->run) return Fail(absl::FailedPreconditionError("the hook has already run"));
  if (hook->buffer_alive.expired()) {
    return Fail(absl::FailedPreconditionError("the hook's Buffer was destroyed: a hook runs on its Buffer"));
  }
  absl::Status ran = hook->run(Stream(stream));
  hook->run = nullptr;
  return Report(ran);
}

void epf_hook_destroy(epf_hook* hook) { delete hook; }

epf_status epf_low_latency_rank_mask(epf_buffer* buffer, epf_tensor* out) {
  if (buffer == nullptr || out == nullptr) return Fail(Null("buffer or out"));
  const TensorView view = buffer->buffer->LowLatencyRankMask();
  if (view.data == nullptr) return Fail(absl::FailedPreconditionError("not a low-latency buffer"));
  *out = FromView(view);
  return Report(absl::OkStatus());
}

epf_status epf_next_low_latency_combine_buffer(epf_buffer* buffer, epf_tensor* out) {
  if (buffer == nullptr || out == nullptr) return Fail(Null("buffer or out"));
  const TensorView view = buffer->buffer->NextLowLatencyCombineBuffer();
  if (view.data == nullptr) return Fail(absl::FailedPreconditionError("not a low-latency buffer"));
  *out = FromView(view);
  return Report(absl::OkStatus());
}

}  // extern "C"
