#include "integration/fabric_under_test.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <iostream>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace epfabric::testing {

std::string UniqueFabricId() {
  static std::atomic<int> counter{0};
  return absl::StrCat("t", getpid(), "-", counter++);
}

absl::StatusOr<std::unique_ptr<FabricUnderTest>> FabricUnderTest::Start(
    int world_size, const std::vector<std::string>& flags, const std::map<int, std::vector<std::string>>& rank_flags,
    const std::string& fabric_id) {
  auto fabric = std::unique_ptr<FabricUnderTest>(new FabricUnderTest());
  fabric->world_size_ = world_size;
  fabric->fabric_id_ = fabric_id.empty() ? UniqueFabricId() : fabric_id;
  fabric->flags_ = flags;
  fabric->rank_flags_ = rank_flags;
  auto zero = DaemonUnderTest::Start(fabric->FlagsFor(0));
  if (!zero.ok()) return zero.status();
  auto address = (*zero)->PeerAddress();
  if (!address.ok()) return address.status();
  fabric->coordinator_ = *address;
  fabric->daemons_[0] = std::move(*zero);
  for (int rank = 1; rank < world_size; ++rank) {
    if (absl::Status started = fabric->Restart(rank); !started.ok()) return started;
  }
  return fabric;
}

FabricUnderTest::~FabricUnderTest() {
  // What the daemons said is the first thing to read when a fabric test fails.
  if (::testing::Test::HasFailure()) {
    for (auto& [rank, daemon] : daemons_) {
      std::cerr << "---- epfabricd rank " << rank << " stderr ----\n" << daemon->process().Stderr();
    }
  }
  daemons_.clear();
}

int FabricUnderTest::MemfdRegions() {
  const std::string label = absl::StrCat("/memfd:epf.", fabric_id_, ".");
  int count = 0;
  for (const auto& [rank, daemon] : daemons_) {
    std::error_code ec;
    for (const auto& entry :
         std::filesystem::directory_iterator(absl::StrCat("/proc/", daemon->process().pid(), "/fd"), ec)) {
      std::error_code link_ec;
      const std::string target = std::filesystem::read_symlink(entry.path(), link_ec).string();
      if (!link_ec && absl::StartsWith(target, label)) ++count;
    }
  }
  return count;
}

std::vector<std::string> FabricUnderTest::FlagsFor(int rank) const {
  std::vector<std::string> flags = {absl::StrCat("--rank=", rank), absl::StrCat("--world_size=", world_size_),
                                    "--fabric_id=" + fabric_id_, "--backend=host"};
  if (rank != 0) flags.push_back("--coordinator=" + coordinator_);
  flags.insert(flags.end(), flags_.begin(), flags_.end());
  if (auto it = rank_flags_.find(rank); it != rank_flags_.end())
    flags.insert(flags.end(), it->second.begin(), it->second.end());
  return flags;
}

absl::Status FabricUnderTest::Restart(int rank, const std::vector<std::string>& extra) {
  std::vector<std::string> flags = FlagsFor(rank);
  flags.insert(flags.end(), extra.begin(), extra.end());
  if (rank == 0 && !coordinator_.empty()) flags.push_back("--peer_listen=" + coordinator_);  // same address again
  auto daemon = DaemonUnderTest::Start(flags);
  if (!daemon.ok()) return daemon.status();
  daemons_[rank] = std::move(*daemon);
  return absl::OkStatus();
}

void FabricUnderTest::Kill(int rank) {
  auto it = daemons_.find(rank);
  if (it == daemons_.end()) return;
  it->second->process().Signal(SIGKILL);
  (void)it->second->process().Wait(absl::Seconds(5));
  daemons_.erase(it);
}

std::unique_ptr<v1::Control::Stub> FabricUnderTest::Control(int rank) {
  return v1::Control::NewStub(daemon(rank).SocketChannel());
}

std::unique_ptr<v1::Ops::Stub> FabricUnderTest::Ops(int rank) { return v1::Ops::NewStub(daemon(rank).SocketChannel()); }

absl::StatusOr<v1::FabricView> FabricUnderTest::Fabric(int rank) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::FabricView view;
  const grpc::Status status = Ops(rank)->GetFabric(&context, v1::GetFabricRequest(), &view);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  return view;
}

absl::StatusOr<v1::FabricView> FabricUnderTest::WaitView(int rank,
                                                         const std::function<bool(const v1::FabricView&)>& predicate,
                                                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::StatusOr<v1::FabricView> view;
  while (true) {
    view = Fabric(rank);
    if (view.ok() && predicate(*view)) return view;
    if (absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("rank ", rank, " view: ", view.ok() ? view->DebugString() : view.status().ToString()));
}

absl::Status FabricUnderTest::WaitComplete(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  auto all_up = [](const v1::FabricView& view) {
    for (const auto& member : view.membership().members()) {
      if (member.state() != v1::MEMBER_STATE_UP) return false;
    }
    return !view.degraded();
  };
  auto coordinator = WaitView(0, all_up, timeout);
  if (!coordinator.ok()) return coordinator.status();
  for (const auto& [rank, daemon] : daemons_) {
    auto view = WaitView(
        rank,
        [&](const v1::FabricView& v) {
          return all_up(v) && v.membership().epoch() >= coordinator->membership().epoch();
        },
        deadline - absl::Now());
    if (!view.ok()) return view.status();
  }
  return absl::OkStatus();
}

}  // namespace epfabric::testing
