// Pod certificates (CN epfabric-member:<lws>:pod:<pod name>, what cert-manager's csi-driver can write for a
// LeaderWorkerSet pod) with real daemons on loopback: a group of three pods forms one fabric; a pod's certificate
// acts only as that pod's ranks and only in its own group's fabric, at the peer port and at start-up.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "integration/fabric_under_test.h"
#include "integration/test_pki.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;
using Code = grpc::StatusCode;

constexpr int kRanksPerPod = 2;

// The pods of LeaderWorkerSet `lws`, group `group`, as its controller names them: the leader "<lws>-<group>",
// worker w "<lws>-<group>-<w>".
std::string PodName(const std::string& lws, int group, int worker) {
  return worker == 0 ? absl::StrCat(lws, "-", group) : absl::StrCat(lws, "-", group, "-", worker);
}

std::string PodCommonName(const std::string& lws, int group, int worker) {
  return absl::StrCat("epfabric-member:", lws, ":pod:", PodName(lws, group, worker));
}

grpc::Status Heartbeat(v1::Peer::Stub& stub, const std::string& fabric_id, int rank) {
  v1::HeartbeatRequest beat;
  beat.set_fabric_id(fabric_id);
  beat.set_rank(rank);
  v1::HeartbeatResponse answer;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return stub.Heartbeat(&context, beat, &answer);
}

class PodCertificates : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    lws_ = UniqueFabricId();  // "t<pid>-<n>": an LWS name that itself ends in "-<number>"
    fabric_id_ = PodName(lws_, 0, 0);
    pki_ = MakeCa(dir_, "namespace");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Each daemon its own key (one csi volume per daemon), the CN of its pod.
  std::map<int, std::vector<std::string>> PerRankCertificates(int pods) {
    std::map<int, std::vector<std::string>> per_rank;
    for (int rank = 0; rank < pods * kRanksPerPod; ++rank) {
      per_rank[rank] = Issue(pki_, absl::StrCat("rank", rank), PodCommonName(lws_, 0, rank / kRanksPerPod));
    }
    return per_rank;
  }

  std::vector<std::string> Flags() const {
    return {"--heartbeat_ms=100", "--heartbeat_misses=3", absl::StrCat("--ranks_per_pod=", kRanksPerPod)};
  }

  std::string dir_, lws_, fabric_id_;
  Pki pki_;
};

TEST_F(PodCertificates, AGroupOfThreePodsFormsOneFabric) {
  auto fabric = FabricUnderTest::Start(3 * kRanksPerPod, Flags(), PerRankCertificates(3), fabric_id_);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete(absl::Seconds(30)).ok()) << "6 daemons of 3 pods with their pods' certificates";
}

TEST_F(PodCertificates, APodActsOnlyAsItsRanksAndOnlyInItsGroupsFabric) {
  auto fabric = FabricUnderTest::Start(2 * kRanksPerPod, Flags(), PerRankCertificates(2), fabric_id_);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());

  // Worker 1 of group 0 holds ranks 2-3: as those, the call passes the credential check (and the membership answers
  // that a heartbeat of incarnation 0 is no live member); as rank 1 or 4 it is refused.
  auto worker = v1::Peer::NewStub(
      TlsPeerChannel((*fabric)->coordinator(), IssueFiles(pki_, "worker1", PodCommonName(lws_, 0, 1))));
  for (int rank : {2, 3}) {
    const grpc::Status own = Heartbeat(*worker, fabric_id_, rank);
    EXPECT_EQ(own.error_code(), Code::NOT_FOUND) << rank << ": " << own.error_message();
  }
  for (int rank : {0, 1, 4}) {
    const grpc::Status other = Heartbeat(*worker, fabric_id_, rank);
    EXPECT_EQ(other.error_code(), Code::PERMISSION_DENIED) << rank << ": " << other.error_message();
    EXPECT_THAT(other.error_message(),
                HasSubstr(absl::StrCat("only rank ", rank, " may call this; the caller is member pod ",
                                       PodName(lws_, 0, 1), " (ranks 2-3)")));
  }

  // Worker 1 of group 1 (another replica of the same LeaderWorkerSet, the same namespace CA): another fabric.
  auto other_group = v1::Peer::NewStub(
      TlsPeerChannel((*fabric)->coordinator(), IssueFiles(pki_, "group1-worker1", PodCommonName(lws_, 1, 1))));
  const grpc::Status foreign = Heartbeat(*other_group, fabric_id_, 2);
  EXPECT_EQ(foreign.error_code(), Code::UNAUTHENTICATED) << foreign.error_message();
  EXPECT_THAT(foreign.error_message(),
              HasSubstr(absl::StrCat("names pod ", PodName(lws_, 1, 1), " of fabric ", PodName(lws_, 1, 0),
                                     " (LeaderWorkerSet ", lws_, " group 1), not ", fabric_id_)));

  // A daemon of group 1 pointed at group 0's coordinator (a crossed address): its own certificate fits its own
  // fabric, so it starts, but group 0 never counts it.
  const v1::MemberInfo before = (*fabric)->Fabric(0)->membership().members(2);
  std::vector<std::string> crossed = Flags();
  const std::vector<std::string> group1_tls = Issue(pki_, "group1-rank2", PodCommonName(lws_, 1, 1));
  crossed.insert(crossed.end(), group1_tls.begin(), group1_tls.end());
  crossed.insert(crossed.end(), {"--rank=2", "--world_size=4", "--backend=host", "--fabric_id=" + PodName(lws_, 1, 0),
                                 "--coordinator=" + (*fabric)->coordinator()});
  auto stray = DaemonUnderTest::Start(crossed);
  ASSERT_TRUE(stray.ok()) << stray.status();
  absl::SleepFor(absl::Milliseconds(1500));
  ASSERT_TRUE((*fabric)->WaitComplete(absl::Seconds(5)).ok()) << "group 0's fabric is untouched";
  const v1::MemberInfo after = (*fabric)->Fabric(0)->membership().members(2);
  EXPECT_EQ(after.incarnation(), before.incarnation());
  EXPECT_EQ(after.peer_address(), before.peer_address());
}

TEST_F(PodCertificates, ADaemonRefusesToStartAsARankItsPodCertificateDoesNotCover) {
  const IssuedFiles worker = IssueFiles(pki_, "worker1", PodCommonName(lws_, 0, 1));
  auto start = [&](const std::vector<std::string>& flags, const IssuedFiles& files) {
    std::vector<std::string> argv = {DaemonBinary(), "--client_socket=" + dir_ + "/d.sock", "--world_size=8",
                                     "--coordinator=127.0.0.1:1", "--backend=host"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const std::vector<std::string> tls = files.Flags();
    argv.insert(argv.end(), tls.begin(), tls.end());
    return RunBinary(argv);
  };
  const std::string names = absl::StrCat("--tls_cert: the certificate (CN '", PodCommonName(lws_, 0, 1),
                                         "') names pod ", PodName(lws_, 0, 1), " (ranks 2-3) of fabric ", fabric_id_);
  for (int rank : {1, 4}) {
    RunResult outside =
        start({absl::StrCat("--rank=", rank), "--fabric_id=" + fabric_id_, "--ranks_per_pod=2"}, worker);
    EXPECT_EQ(outside.exit_code, 2) << outside.err;
    EXPECT_THAT(outside.err, HasSubstr(absl::StrCat(names, ", not --rank=", rank)));
  }
  // Another group's fabric, and no --ranks_per_pod: refused, saying which.
  RunResult foreign = start({"--rank=2", "--fabric_id=" + PodName(lws_, 1, 0), "--ranks_per_pod=2"}, worker);
  EXPECT_EQ(foreign.exit_code, 2);
  EXPECT_THAT(foreign.err, HasSubstr(absl::StrCat("names pod ", PodName(lws_, 0, 1), " of fabric ", fabric_id_)));
  RunResult no_size = start({"--rank=2", "--fabric_id=" + fabric_id_}, worker);
  EXPECT_EQ(no_size.exit_code, 2);
  EXPECT_THAT(no_size.err, HasSubstr("takes no pod certificates (no --ranks_per_pod)"));
  // A certificate that is no member's at all.
  RunResult ops = start({"--rank=2", "--fabric_id=" + fabric_id_, "--ranks_per_pod=2"},
                        IssueFiles(pki_, "ops", "epfabric-ops:" + fabric_id_));
  EXPECT_EQ(ops.exit_code, 2);
  EXPECT_THAT(ops.err, HasSubstr("is not a member's"));
}

}  // namespace
}  // namespace epfabric::testing
