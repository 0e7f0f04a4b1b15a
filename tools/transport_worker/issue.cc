#include "issue.h"

#include <cuda_runtime.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "epfabric/kernels/transport/device.h"

namespace epfabric::tools {

using kernels::transport::Command;
using kernels::transport::Opcode;
using kernels::transport::RingAt;
using kernels::transport::RingIssuer;

absl::StatusOr<AttachedRank> AttachRank(const std::string& socket, const std::string& group, int rank,
                                        const std::string& token, int device) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) == cudaSuccess && gpus > 0) cudaSetDevice(device >= 0 ? device : rank % gpus);
  AttachedRank attached;
  auto client = client::Client::Connect(socket);
  if (!client.ok()) return client.status();
  attached.client = std::move(*client);
  auto lease = attached.client->Attach(group, rank, token);
  if (!lease.ok()) return lease.status();
  attached.lease = std::move(*lease);
  if (attached.lease->commands_region() == nullptr) {
    return absl::FailedPreconditionError("the group has no transport (num_rdma_bytes 0?)");
  }
  return attached;
}

absl::StatusOr<std::unique_ptr<Issuers>> Issuers::Create(client::Lease& lease, bool from_device,
                                                         absl::Duration timeout) {
  auto issuers = std::unique_ptr<Issuers>(new Issuers());
  issuers->from_device_ = from_device;
  cudaGetDevice(&issuers->device_);
  issuers->timeout_ = timeout;
  issuers->self_rank_ = lease.rank();
  issuers->slots_ = lease.group().ring_slots();
  const int channels = static_cast<int>(lease.group().transport_channels());
  for (int c = 0; c < channels; ++c) {
    void* ring = RingAt(lease.commands_region(), c, issuers->slots_);
    auto issuer = RingIssuer::Create(ring, c, issuers->slots_);
    if (!issuer.ok()) return issuer.status();
    issuers->host_.push_back(*issuer);
    issuers->host_rings_.push_back(ring);
  }
  if (from_device) {
    issuers->device_base_ = lease.commands_region_device();
    if (issuers->device_base_ == nullptr)
      return absl::FailedPreconditionError("the command rings are not mapped for CUDA");
    if (cudaMalloc(&issuers->device_next_, sizeof(unsigned long long) * channels) != cudaSuccess ||
        cudaMemset(issuers->device_next_, 0, sizeof(unsigned long long) * channels) != cudaSuccess) {
      return absl::InternalError("cudaMalloc of the ring counters failed");
    }
  }
  return issuers;
}

Issuers::~Issuers() {
  if (device_next_ != nullptr) cudaFree(device_next_);
}

absl::Status Issuers::Run(int channel, const std::vector<Command>& commands, bool quiet) {
  if (channel < 0 || channel >= static_cast<int>(host_.size())) return absl::InvalidArgumentError("channel");
  if (from_device_) return RunOnDevice(channel, commands, quiet);
  RingIssuer& ring = host_[channel];
  for (const Command& c : commands) {
    const absl::Status issued = static_cast<Opcode>(c.opcode) == Opcode::kSignalAdd
                                    ? ring.SignalAdd(c.dst_rank, c.dst_offset, static_cast<int64_t>(c.arg), timeout_)
                                    : ring.Put(c.dst_rank, c.dst_offset, c.src_offset, c.arg, timeout_);
    if (!issued.ok()) return issued;
  }
  return quiet ? ring.Quiet(timeout_) : absl::OkStatus();
}

absl::Status Issuers::RunOnDevice(int channel, const std::vector<Command>& commands, bool quiet) {
  // Each channel runs on a thread of its own, whose current device starts as 0: the counters, the commands and the
  // kernel belong on the lease's device.
  cudaSetDevice(device_);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  Command* device_commands = nullptr;
  int* offsets = nullptr;
  kernels::KernelStatus* status = nullptr;
  int* failed = nullptr;
  const int host_offsets[2] = {0, static_cast<int>(commands.size())};
  cudaMalloc(&device_commands, sizeof(Command) * std::max<size_t>(1, commands.size()));
  cudaMalloc(&offsets, sizeof(host_offsets));
  cudaMallocManaged(&status, sizeof(kernels::KernelStatus));
  cudaMallocManaged(&failed, sizeof(int));
  *status = {};
  *failed = 0;
  cudaMemcpy(device_commands, commands.data(), sizeof(Command) * commands.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(offsets, host_offsets, sizeof(host_offsets), cudaMemcpyHostToDevice);
  // The ring's next index may have moved on through host issuers (RingControl::reserved): the kernel starts from it,
  // and hands its own back, so that host and device issuing can take turns on one ring.
  auto& reserved = static_cast<kernels::transport::RingControl*>(host_rings_[channel])->reserved;
  unsigned long long next = std::atomic_ref<uint64_t>(reserved).load();
  cudaMemcpy(device_next_ + channel, &next, sizeof(next), cudaMemcpyHostToDevice);
  kernels::transport::DeviceRing ring;
  ring.ring = RingAt(device_base_, channel, slots_);
  ring.next = device_next_ + channel;
  ring.slots = slots_;
  ring.channel = channel;
  absl::Status result = kernels::transport::LaunchIssueCommands(
      {ring}, device_commands, offsets, quiet, self_rank_, static_cast<uint64_t>(absl::ToInt64Nanoseconds(timeout_)),
      status, failed, stream);
  if (result.ok() && cudaStreamSynchronize(stream) != cudaSuccess) result = absl::InternalError("kernel failed");
  if (cudaMemcpy(&next, device_next_ + channel, sizeof(next), cudaMemcpyDeviceToHost) == cudaSuccess) {
    std::atomic_ref<uint64_t>(reserved).store(next);
  }
  if (result.ok() && *failed != 0) {
    result = kernels::transport::RingErrorStatus(
        channel, *static_cast<const kernels::transport::RingControl*>(host_rings_[channel]));
  }
  if (result.ok() && status->code != kernels::kKernelStatusOk) {
    result = absl::DeadlineExceededError(absl::StrCat("transport ring ", channel, ": device wait (site ", status->site,
                                                      ") timed out; waiting on rank ", status->peer_rank));
  }
  cudaFree(device_commands);
  cudaFree(offsets);
  cudaFree(status);
  cudaFree(failed);
  cudaStreamDestroy(stream);
  return result;
}

}  // namespace epfabric::tools
