// Control-plane benchmark: how long a fabric of N real epfabricd processes (host backend, loopback) takes to form,
// and how long CreateGroup/DeleteGroup take across 8 members. Prints a table and writes bench/results/fabric-*.json.
//
// Formation is timed from spawning rank 0 to the moment every daemon reports every rank UP at the final epoch:
// process start-up is included, because that is what a restart of the whole fabric costs.
//
// Usage: fabric_bench [--out DIR] [--sizes 8,32,64] [--group_iters N]
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/report.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "integration/daemon_under_test.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"

namespace epfabric::bench {
namespace {

using testing::DaemonBinary;
using testing::MakeTempDir;
using testing::Subprocess;

struct Spawned {
  std::unique_ptr<Subprocess> process;
  std::string socket;
};

absl::StatusOr<v1::FabricView> GetFabric(const std::string& socket) {
  auto stub = v1::Ops::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::FabricView view;
  const grpc::Status status = stub->GetFabric(&context, v1::GetFabricRequest(), &view);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  return view;
}

bool Complete(const v1::FabricView& view, uint64_t min_epoch) {
  if (view.membership().epoch() < min_epoch) return false;
  for (const auto& member : view.membership().members()) {
    if (member.state() != v1::MEMBER_STATE_UP) return false;
  }
  return true;
}

// Forms a fabric of `n` daemons; returns milliseconds from the first spawn to complete everywhere.
absl::StatusOr<double> FormFabric(int n, const std::string& dir) {
  const std::string fabric_id = testing::UniqueFabricId();
  std::vector<Spawned> daemons(n);
  const absl::Time start = absl::Now();
  auto spawn = [&](int rank, const std::string& coordinator) -> absl::Status {
    daemons[rank].socket = absl::StrCat(dir, "/d", rank, ".sock");
    std::vector<std::string> argv = {DaemonBinary(),
                                     "--client_socket=" + daemons[rank].socket,
                                     absl::StrCat("--rank=", rank),
                                     absl::StrCat("--world_size=", n),
                                     "--fabric_id=" + fabric_id,
                                     "--backend=host",
                                     "--log_level=warn",
                                     "--peer_listen=127.0.0.1:0"};
    if (rank != 0) argv.push_back("--coordinator=" + coordinator);
    auto process = Subprocess::Start(testing::WithPeerCredential(argv));
    if (!process.ok()) return process.status();
    daemons[rank].process = std::make_unique<Subprocess>(std::move(*process));
    return absl::OkStatus();
  };
  if (absl::Status s = spawn(0, ""); !s.ok()) return s;
  // Rank 0's peer address (port chosen at start) is what the others need.
  std::string coordinator;
  while (absl::Now() - start < absl::Seconds(20)) {
    auto view = GetFabric(daemons[0].socket);
    if (view.ok()) {
      coordinator = view->membership().members(0).peer_address();
      break;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  if (coordinator.empty()) return absl::DeadlineExceededError("rank 0 did not come up");
  for (int rank = 1; rank < n; ++rank) {
    if (absl::Status s = spawn(rank, coordinator); !s.ok()) return s;
  }
  uint64_t epoch = 0;
  while (true) {
    auto view = GetFabric(daemons[0].socket);
    if (view.ok() && Complete(*view, 0)) {
      epoch = view->membership().epoch();
      break;
    }
    if (absl::Now() - start > absl::Seconds(60)) return absl::DeadlineExceededError("fabric did not form in 60 s");
    absl::SleepFor(absl::Milliseconds(2));
  }
  for (int rank = 1; rank < n; ++rank) {
    while (true) {
      auto view = GetFabric(daemons[rank].socket);
      if (view.ok() && Complete(*view, epoch)) break;
      if (absl::Now() - start > absl::Seconds(60)) return absl::DeadlineExceededError("a member lagged behind");
      absl::SleepFor(absl::Milliseconds(2));
    }
  }
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  for (Spawned& d : daemons) d.process->Signal(SIGTERM);
  for (Spawned& d : daemons) (void)d.process->Wait(absl::Seconds(5));
  return ms;
}

}  // namespace
}  // namespace epfabric::bench

int main(int argc, char** argv) {
  using namespace epfabric;
  std::string out_dir = "bench/results";
  std::vector<int> sizes = {8, 32, 64};
  int group_iters = 30;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
      out_dir = argv[++i];
    } else if (std::strcmp(argv[i], "--sizes") == 0 && i + 1 < argc) {
      sizes.clear();
      for (absl::string_view part : absl::StrSplit(argv[++i], ',')) {
        int n = 0;
        if (absl::SimpleAtoi(part, &n) && n > 0) sizes.push_back(n);
      }
    } else if (std::strcmp(argv[i], "--group_iters") == 0 && i + 1 < argc) {
      group_iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: fabric_bench [--out DIR] [--sizes 8,32,64] [--group_iters N]\n");
      return 2;
    }
  }
  bench::Report report("fabric");
  report.SetDevice("host");
  report.SetConfig("backend", std::string("host"));
  report.SetConfig("transport", std::string("loopback TCP + Unix sockets"));
  report.SetConfig("heartbeat_ms", 1000.0);
  std::printf("%-28s %12s %12s %12s\n", "measure", "median", "p10", "p90");

  const std::string dir = testing::MakeTempDir();
  for (int n : sizes) {
    std::vector<double> samples;
    const int repeats = n <= 8 ? 5 : (n <= 32 ? 3 : 2);
    for (int r = 0; r < repeats; ++r) {
      auto ms = bench::FormFabric(n, dir);
      if (!ms.ok()) {
        std::fprintf(stderr, "fabric of %d: %s\n", n, ms.status().ToString().c_str());
        return 1;
      }
      samples.push_back(*ms);
    }
    const bench::Summary s = bench::Summarize(samples);
    std::printf("%-28s %9.1f ms %9.1f ms %9.1f ms   (%zu runs)\n", absl::StrCat("form fabric of ", n).c_str(), s.median,
                s.p10, s.p90, s.count);
    report.SetResult(absl::StrCat("form_", n, "_ms"), s.median);
    report.SetResult(absl::StrCat("form_", n, "_p90_ms"), s.p90);
  }

  // CreateGroup / DeleteGroup latency across 8 members, asked through a non-coordinator (one forward hop).
  {
    auto fabric = testing::FabricUnderTest::Start(8, {"--log_level=warn"});
    if (!fabric.ok() || !(*fabric)->WaitComplete().ok()) {
      std::fprintf(stderr, "cannot form the 8-daemon fabric for the group benchmark\n");
      return 1;
    }
    auto control = (*fabric)->Control(3);
    std::vector<double> create_ms, delete_ms;
    for (int i = 0; i < group_iters; ++i) {
      v1::CreateGroupRequest request;
      request.set_name(absl::StrCat("bench-", i));
      for (int r = 0; r < 8; ++r) request.add_ranks(r);
      request.set_num_nvl_bytes(64 << 20);
      grpc::ClientContext create_context;
      v1::CreateGroupResponse created;
      absl::Time t = absl::Now();
      grpc::Status status = control->CreateGroup(&create_context, request, &created);
      create_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t));
      if (!status.ok()) {
        std::fprintf(stderr, "CreateGroup: %s\n", status.error_message().c_str());
        return 1;
      }
      v1::DeleteGroupRequest del;
      del.set_name(request.name());
      del.set_token(created.token());
      grpc::ClientContext delete_context;
      v1::DeleteGroupResponse deleted;
      t = absl::Now();
      status = control->DeleteGroup(&delete_context, del, &deleted);
      delete_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t));
      if (!status.ok()) {
        std::fprintf(stderr, "DeleteGroup: %s\n", status.error_message().c_str());
        return 1;
      }
    }
    const bench::Summary c = bench::Summarize(create_ms);
    const bench::Summary d = bench::Summarize(delete_ms);
    std::printf("%-28s %9.2f ms %9.2f ms %9.2f ms   (%zu runs)\n", "CreateGroup 8 x 64 MiB", c.median, c.p10, c.p90,
                c.count);
    std::printf("%-28s %9.2f ms %9.2f ms %9.2f ms   (%zu runs)\n", "DeleteGroup 8 ranks", d.median, d.p10, d.p90,
                d.count);
    report.SetConfig("group_ranks", 8.0);
    report.SetConfig("group_nvl_bytes", 64.0 * (1 << 20));
    report.SetResult("create_group_8_ms", c.median);
    report.SetResult("create_group_8_p90_ms", c.p90);
    report.SetResult("delete_group_8_ms", d.median);
  }
  auto path = report.WriteTo(out_dir);
  if (!path.ok()) {
    std::fprintf(stderr, "%s\n", path.status().ToString().c_str());
    return 1;
  }
  std::printf("wrote %s\n", path->c_str());
  return 0;
}
