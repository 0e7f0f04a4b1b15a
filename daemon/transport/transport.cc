#include "transport/transport.h"

#include "absl/strings/str_cat.h"
#include "epfabric/common/status_macros.h"
#include "logging.h"
#include "transport/verbs/verbs_logic.h"
#include "transport/verbs/verbs_wire.h"

namespace epfabric::daemon::transport {

using kernels::transport::RingBytes;

GroupTransport::GroupTransport(Proxy* proxy, std::shared_ptr<memory::Region> commands, int channels, uint32_t slots)
    : proxy_(proxy), slots_(slots), commands_(std::move(commands)) {
  char* base = static_cast<char*>(commands_->base());
  for (int c = 0; c < channels; ++c) {
    rings_.push_back(std::make_unique<CommandRing>(base + c * RingBytes(slots), c, slots));
    rings_.back()->Initialize();
  }
}

GroupTransport::~GroupTransport() {
  if (proxied_) {
    for (auto& ring : rings_) proxy_->Remove(ring.get());
  }
  if (link_ != nullptr) link_->Shutdown();  // completes what is in flight (Cancelled) into the rings
}

absl::Status GroupTransport::Connect(const std::vector<v1::TransportEndpoint>& members) {
  // Once: a second Commit must not open a second set of connections or give a ring a second proxy thread.
  if (proxied_) return absl::FailedPreconditionError("transport: the group is connected already");
  const int self = bounds_.self_rank;
  if (self < 0 || self >= static_cast<int>(members.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport: ", members.size(), " endpoints do not include this member's group rank ", self));
  }
  // This member's own region is bounded by its own allocation, never by what a Commit claims about it.
  if (members[self].region_bytes() != local_region_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("members[", self,
                                                   "].transport.region_bytes: ", members[self].region_bytes(),
                                                   " bytes, but this member's region has ", local_region_bytes_));
  }
  bounds_.region_bytes.clear();
  for (const v1::TransportEndpoint& member : members) bounds_.region_bytes.push_back(member.region_bytes());
  bounds_.region_bytes[self] = local_region_bytes_;
  EPF_RETURN_IF_ERROR(link_->Connect(members));
  for (auto& ring : rings_) proxy_->Add({ring.get(), link_.get(), &bounds_});
  proxied_ = true;
  return absl::OkStatus();
}

void GroupTransport::Stop(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (auto& ring : rings_) ring->Stop(std::max(absl::ZeroDuration(), deadline - absl::Now()));
}

void GroupTransport::Reset() {
  absl::StatusOr<std::shared_ptr<memory::Region>> fresh = absl::FailedPreconditionError("no allocator");
  if (allocator_ != nullptr) fresh = allocator_->Allocate(command_spec_);
  if (!fresh.ok()) {
    Logger("transport")
        ->warn("group '{}': no new command region for the next lease ({}); the zeroed one serves again",
               command_spec_.group, fresh.status().ToString());
    for (auto& ring : rings_) ring->Reset();
    return;
  }
  char* base = static_cast<char*>((*fresh)->base());
  for (size_t c = 0; c < rings_.size(); ++c) {
    // Out of the proxy while it moves, so that no Poll reads the old memory's slots meanwhile.
    if (proxied_) proxy_->Remove(rings_[c].get());
    rings_[c]->Rebind(base + c * RingBytes(slots_));
    rings_[c]->Reset();
    if (proxied_) proxy_->Add({rings_[c].get(), link_.get(), &bounds_});
  }
  absl::MutexLock lock(&commands_mutex_);
  commands_ = std::move(*fresh);
}

std::vector<RingCounters> GroupTransport::counters() const {
  std::vector<RingCounters> all;
  for (const auto& ring : rings_) all.push_back(ring->counters());
  return all;
}

void GroupTransport::Complete(uint64_t cookie, absl::Status status) {
  const int channel = CommandRing::CookieChannel(cookie);
  if (channel >= 0 && channel < static_cast<int>(rings_.size())) rings_[channel]->Complete(cookie, status);
}

absl::StatusOr<std::unique_ptr<Transport>> Transport::Start(const TransportOptions& options) {
  auto transport = std::unique_ptr<Transport>(new Transport());
  v1::Transport kind = options.kind;
  if (kind == v1::TRANSPORT_UNSPECIFIED) {
    kind = verbs::ChooseTransport("auto", verbs::ProbeVerbs().ok() && verbs::CanRegister(options.device).ok());
  }
  if (kind == v1::TRANSPORT_VERBS) {
    EPF_RETURN_IF_ERROR(verbs::CanRegister(options.device));
    EPF_ASSIGN_OR_RETURN(transport->wire_, verbs::MakeVerbsWire(verbs::VerbsOptions{}));
  } else {
    EPF_ASSIGN_OR_RETURN(std::unique_ptr<SocketWire> socket, SocketWire::Start(options.socket));
    transport->socket_ = socket.get();
    transport->wire_ = std::move(socket);
  }
  transport->proxy_ = std::make_unique<Proxy>(options.proxy);
  transport->command_allocator_ = memory::MakeHostAllocator(absl::StrCat(options.name_prefix, ".cmd"), 0);
  return transport;
}

std::string Transport::data_address() const { return socket_ != nullptr ? socket_->address() : ""; }

absl::StatusOr<std::unique_ptr<GroupTransport>> Transport::OpenGroup(const GroupTransportSpec& spec,
                                                                     v1::TransportEndpoint* local) {
  if (!kernels::transport::ValidRingSlots(spec.slots) || spec.channels < 1 ||
      spec.channels > kernels::transport::kMaxChannels) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport: ", spec.channels, " channels of ", spec.slots, " slots"));
  }
  memory::RegionSpec region;
  region.group = spec.group;
  region.rank = spec.self_rank;
  region.bytes = kernels::transport::CommandRegionBytes(spec.channels, spec.slots);
  region.kind = v1::RegionDescriptor::KIND_COMMANDS;
  EPF_ASSIGN_OR_RETURN(std::shared_ptr<memory::Region> commands, command_allocator_->Allocate(region));
  auto group =
      std::unique_ptr<GroupTransport>(new GroupTransport(proxy_.get(), std::move(commands), spec.channels, spec.slots));
  GroupSetup setup;
  setup.group = spec.group;
  setup.self_rank = spec.self_rank;
  setup.world = spec.world;
  setup.channels = spec.channels;
  setup.data_key = spec.data_key;
  setup.region = spec.rdma;
  setup.sink = group.get();
  group->bounds_.self_rank = spec.self_rank;
  group->allocator_ = command_allocator_.get();
  group->command_spec_ = region;
  group->local_region_bytes_ = spec.rdma != nullptr ? spec.rdma->descriptor().size_bytes() : 0;
  EPF_ASSIGN_OR_RETURN(group->link_, wire_->Open(setup, local));
  return group;
}

}  // namespace epfabric::daemon::transport
