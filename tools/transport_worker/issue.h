// Issuing a list of commands on one ring, from host code (RingIssuer) or from a CUDA kernel (LaunchIssueCommands),
// then optionally waiting for their completion (quiet).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epfabric/client/client.h"
#include "epfabric/kernels/transport/issuer.h"

namespace epfabric::tools {

// A client attached as one rank, its CUDA context on its own daemon's GPU (`device`; -1: rank mod the visible
// GPUs): the kernels, copies and the mapping of the command rings belong there, not on GPU 0 for every rank.
struct AttachedRank {
  std::unique_ptr<client::Client> client;  // outlives the lease
  std::unique_ptr<client::Lease> lease;
};
absl::StatusOr<AttachedRank> AttachRank(const std::string& socket, const std::string& group, int rank,
                                        const std::string& token, int device);

class Issuers {
 public:
  static absl::StatusOr<std::unique_ptr<Issuers>> Create(client::Lease& lease, bool from_device,
                                                         absl::Duration timeout);
  ~Issuers();
  // Thread-safe across channels (one caller per channel at a time).
  absl::Status Run(int channel, const std::vector<kernels::transport::Command>& commands, bool quiet);

 private:
  Issuers() = default;
  absl::Status RunOnDevice(int channel, const std::vector<kernels::transport::Command>& commands, bool quiet);

  std::vector<kernels::transport::RingIssuer> host_;
  std::vector<void*> host_rings_;  // RingControl of each channel (host pointers)
  bool from_device_ = false;
  absl::Duration timeout_;
  int self_rank_ = 0;
  int device_ = 0;  // the CUDA device of the lease (channel threads start on device 0: they switch to it)
  uint32_t slots_ = 0;
  void* device_base_ = nullptr;                // the command region's device pointer
  unsigned long long* device_next_ = nullptr;  // per channel, device memory
};

}  // namespace epfabric::tools
