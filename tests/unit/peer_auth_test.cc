// Fabric-secret proofs and the peer authenticator's decisions, without a daemon.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "epfabric/common/peer_auth.h"
#include "security/peer_authenticator.h"

namespace epfabric {
namespace {

using common::PeerProofClaim;
using common::PeerRole;
using ::testing::HasSubstr;

constexpr char kSecret[] = "0123456789abcdef-fabric-secret";
constexpr char kJoin[] = "/epfabric.v1.Peer/Join";
constexpr char kBody[] = "serialized request";

TEST(PeerProof, VerifiesForTheSameFabricMethodAndTime) {
  const absl::Time now = absl::Now();
  const std::string proof = common::MakePeerProof(kSecret, "fab", kJoin, {PeerRole::kMember, 3}, kBody, now);
  auto claim = common::VerifyPeerProof(kSecret, "fab", kJoin, proof, kBody, now + absl::Seconds(1));
  ASSERT_TRUE(claim.ok()) << claim.status();
  EXPECT_EQ(claim->claim.role, PeerRole::kMember);
  EXPECT_EQ(claim->claim.rank, 3);
  EXPECT_EQ(claim->nonce.size(), 24u);
  // Two proofs for the same call differ (fresh nonce).
  EXPECT_NE(proof, common::MakePeerProof(kSecret, "fab", kJoin, {PeerRole::kMember, 3}, kBody, now));
}

TEST(PeerProof, RefusesAnythingElse) {
  const absl::Time now = absl::Now();
  const std::string proof = common::MakePeerProof(kSecret, "fab", kJoin, {PeerRole::kMember, 3}, kBody, now);
  auto expect_refused = [](const absl::StatusOr<common::VerifiedPeerProof>& claim, const std::string& why) {
    ASSERT_FALSE(claim.ok()) << "expected a refusal: " << why;
    EXPECT_EQ(claim.status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_THAT(claim.status().message(), HasSubstr(why));
  };
  expect_refused(common::VerifyPeerProof("another-secret-of-16+", "fab", kJoin, proof, kBody, now), "does not verify");
  expect_refused(common::VerifyPeerProof(kSecret, "other", kJoin, proof, kBody, now), "does not verify");
  expect_refused(common::VerifyPeerProof(kSecret, "fab", "/epfabric.v1.Peer/CommitGroup", proof, kBody, now),
                 "does not verify");
  expect_refused(common::VerifyPeerProof(kSecret, "fab", kJoin, proof, kBody, now + absl::Minutes(2)), "clock");
  expect_refused(common::VerifyPeerProof(kSecret, "fab", kJoin, "", kBody, now), "no fabric credential");
  expect_refused(common::VerifyPeerProof(kSecret, "fab", kJoin, "v1:member:3", kBody, now), "malformed");
  // The request is signed: the same proof on another body is refused.
  expect_refused(common::VerifyPeerProof(kSecret, "fab", kJoin, proof, "another request", now),
                 "made for another request");
  // Numbers have one spelling: "+3" or " 3" for 3 is another text for the same proof.
  std::string respelled = proof;
  respelled.replace(respelled.find(":3:"), 3, ":+3:");
  expect_refused(common::VerifyPeerProof(kSecret, "fab", kJoin, respelled, kBody, now), "malformed");
  // The rank is signed: changing it breaks the proof.
  std::string forged = proof;
  forged.replace(forged.find(":3:"), 3, ":0:");
  expect_refused(common::VerifyPeerProof(kSecret, "fab", kJoin, forged, kBody, now), "does not verify");
}

class SecretFile : public ::testing::Test {
 protected:
  std::string Write(const std::string& content, std::filesystem::perms perms) {
    const std::string path = dir_ + "/secret" + std::to_string(count_++);
    std::ofstream(path) << content;
    std::filesystem::permissions(path, perms);
    return path;
  }
  void SetUp() override {
    char tmpl[] = "/tmp/epf-secret-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
  int count_ = 0;
};

TEST_F(SecretFile, ReadsAPrivateFileAndTrimsTheNewline) {
  using std::filesystem::perms;
  auto secret = common::ReadFabricSecretFile(Write("abcdefghijklmnopq\n", perms::owner_read | perms::owner_write), "s");
  ASSERT_TRUE(secret.ok()) << secret.status();
  EXPECT_EQ(*secret, "abcdefghijklmnopq");
}

TEST_F(SecretFile, RefusesOpenModesShortSecretsAndMissingFiles) {
  using std::filesystem::perms;
  auto open = common::ReadFabricSecretFile(Write("abcdefghijklmnopq", perms::owner_all | perms::group_read), "s");
  EXPECT_THAT(open.status().message(), HasSubstr("must not be readable or writable by group or others"));
  auto shorter = common::ReadFabricSecretFile(Write("short\n", perms::owner_read), "s");
  EXPECT_THAT(shorter.status().message(), HasSubstr("needs at least 16"));
  auto missing = common::ReadFabricSecretFile(dir_ + "/none", "fabric_secret_file");
  EXPECT_THAT(missing.status().message(), HasSubstr("--fabric_secret_file: cannot open"));
}

TEST(PeerAuthenticator, SecretModeNeedsAProofAndBindsTheRank) {
  daemon::security::PeerAuthenticator auth({"fab", kSecret, /*mutual_tls=*/false, /*insecure=*/false});
  const absl::Time now = absl::Now();
  auto none = auth.Check(kJoin, nullptr, "", kBody, now);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated);
  auto member = auth.Check(
      kJoin, nullptr, common::MakePeerProof(kSecret, "fab", kJoin, {PeerRole::kMember, 2}, kBody, now), kBody, now);
  ASSERT_TRUE(member.ok()) << member.status();
  EXPECT_TRUE(member->authenticated);
  EXPECT_EQ(member->first_rank, 2);
  EXPECT_EQ(member->end_rank, 3);
  auto ops = auth.Check(kJoin, nullptr, common::MakePeerProof(kSecret, "fab", kJoin, {PeerRole::kOps, -1}, kBody, now),
                        kBody, now);
  ASSERT_TRUE(ops.ok());
  EXPECT_EQ(ops->role, PeerRole::kOps);
}

TEST(PeerAuthenticator, TlsModeReadsTheRoleFromTheCommonName) {
  daemon::security::PeerAuthenticator auth({"fab", "", /*mutual_tls=*/true, /*insecure=*/false});
  const absl::Time now = absl::Now();
  const std::string member_cn = daemon::security::MemberCommonName("fab", 5);
  auto member = auth.Check(kJoin, &member_cn, "", kBody, now);
  ASSERT_TRUE(member.ok()) << member.status();
  EXPECT_EQ(member->first_rank, 5);
  EXPECT_TRUE(member->ActsAs(5));
  EXPECT_FALSE(member->ActsAs(4));
  const std::string ops_cn = daemon::security::OpsCommonName("fab");
  EXPECT_EQ(auth.Check(kJoin, &ops_cn, "", kBody, now)->role, PeerRole::kOps);
  for (const std::string cn : {"localhost", "epfabric-member:other:1", "epfabric-member:fab:-1", "epfabric-ops:x"}) {
    auto refused = auth.Check(kJoin, &cn, "", kBody, now);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << cn;
  }
  EXPECT_EQ(auth.Check(kJoin, nullptr, "", kBody, now).status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(PeerAuthenticator, TlsAndSecretMustNameTheSameRank) {
  daemon::security::PeerAuthenticator auth({"fab", kSecret, /*mutual_tls=*/true, /*insecure=*/false});
  const absl::Time now = absl::Now();
  const std::string cn = daemon::security::MemberCommonName("fab", 1);
  EXPECT_TRUE(auth.Check(kJoin, &cn, common::MakePeerProof(kSecret, "fab", kJoin, {PeerRole::kMember, 1}, kBody, now),
                         kBody, now)
                  .ok());
  auto mismatch = auth.Check(
      kJoin, &cn, common::MakePeerProof(kSecret, "fab", kJoin, {PeerRole::kMember, 0}, kBody, now), kBody, now);
  EXPECT_THAT(mismatch.status().message(), HasSubstr("the certificate names member rank 1"));
}

// ---- pod certificates (LeaderWorkerSet): the pod's name gives the fabric and the ranks ----

TEST(MemberScope, APodCertificateCoversItsWorkersRanksInItsGroupsFabric) {
  using daemon::security::MemberScopeOf;
  auto leader = MemberScopeOf("epfabric-member:moe:pod:moe-0", "moe-0", 2);
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_EQ(leader->first_rank, 0);
  EXPECT_EQ(leader->end_rank, 2);
  EXPECT_EQ(leader->Describe(), "pod moe-0 (ranks 0-1)");
  auto worker = MemberScopeOf("epfabric-member:moe:pod:moe-0-3", "moe-0", 2);
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->first_rank, 6);
  EXPECT_EQ(worker->end_rank, 8);
  EXPECT_TRUE(worker->Covers(7));
  EXPECT_FALSE(worker->Covers(8));
  EXPECT_FALSE(worker->Covers(5));
  // An LWS name with dashes and digits of its own, a group past 9, 8 GPUs per pod.
  auto long_name = MemberScopeOf("epfabric-member:ds-v3-2:pod:ds-v3-2-12-5", "ds-v3-2-12", 8);
  ASSERT_TRUE(long_name.ok()) << long_name.status();
  EXPECT_EQ(long_name->first_rank, 40);
  EXPECT_EQ(long_name->end_rank, 48);
  // The literal rank form still holds.
  auto literal = MemberScopeOf("epfabric-member:moe-0:3", "moe-0", 2);
  ASSERT_TRUE(literal.ok()) << literal.status();
  EXPECT_EQ(literal->Describe(), "rank 3");
}

TEST(MemberScope, RefusesPodsOfOtherGroupsAndNamesNoLwsPodHas) {
  using daemon::security::MemberScopeOf;
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"epfabric-member:moe:pod:moe-1-1", "names pod moe-1-1 of fabric moe-1 (LeaderWorkerSet moe group 1), not moe-0"},
      {"epfabric-member:moe:pod:moe-1", "of fabric moe-1"},
      // Another LWS whose name ends like a group of this one ("moe-0" group 2's leader): its own CN names it.
      {"epfabric-member:moe-0:pod:moe-0-2", "of fabric moe-0-2"},
      {"epfabric-member:moe:pod:other-0-1", "which is no pod of LeaderWorkerSet moe"},
      {"epfabric-member:moe:pod:moe-0-0", "is not 'moe-<group>' or 'moe-<group>-<worker>'"},
      {"epfabric-member:moe:pod:moe-0-01", "is not 'moe-<group>'"},
      {"epfabric-member:moe:pod:moe-00-1", "is not 'moe-<group>'"},
      {"epfabric-member:moe:pod:moe-0-1-1", "is not 'moe-<group>'"},
      {"epfabric-member:moe:pod:moe-0-+1", "is not 'moe-<group>'"},
      {"epfabric-member:moe:pod:moe-0-", "is not 'moe-<group>'"},
      {"epfabric-member:moe:pod:moe-0-99999", "beyond 4095"},
      {"epfabric-member::pod:-0-1", "is neither a rank's nor a pod's"},
      {"epfabric-member:moe:node:moe-0-1", "is neither a rank's nor a pod's"},
      {"epfabric-member:moe-1:0", "names fabric moe-1, not moe-0"},
      {"epfabric-member:moe-0:01", "names no rank"},
      {"epfabric-ops:moe-0", "is not a member's"},
  };
  for (const auto& [cn, why] : refused) {
    auto scope = MemberScopeOf(cn, "moe-0", 2);
    ASSERT_FALSE(scope.ok()) << cn;
    EXPECT_EQ(scope.status().code(), absl::StatusCode::kUnauthenticated) << cn;
    EXPECT_THAT(scope.status().message(), HasSubstr(why)) << cn;
  }
  // Without --ranks_per_pod a pod certificate says nothing about ranks: refused, and the message says what is missing.
  EXPECT_THAT(MemberScopeOf("epfabric-member:moe:pod:moe-0-1", "moe-0", 0).status().message(),
              HasSubstr("takes no pod certificates (no --ranks_per_pod)"));
}

TEST(PeerAuthenticator, APodCertificateActsOnlyAsItsPodsRanks) {
  daemon::security::PeerAuthConfig config{"moe-0", "", /*mutual_tls=*/true, /*insecure=*/false};
  config.ranks_per_pod = 2;
  daemon::security::PeerAuthenticator auth(config);
  const absl::Time now = absl::Now();
  const std::string worker_cn = "epfabric-member:moe:pod:moe-0-1";
  auto worker = auth.Check(kJoin, &worker_cn, "", kBody, now);
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_TRUE(worker->ActsAs(2));
  EXPECT_TRUE(worker->ActsAs(3));
  EXPECT_FALSE(worker->ActsAs(1));
  EXPECT_FALSE(worker->ActsAs(4));
  EXPECT_EQ(worker->Describe(), "member pod moe-0-1 (ranks 2-3)");
  const std::string other_group = "epfabric-member:moe:pod:moe-1-1";
  auto refused = auth.Check(kJoin, &other_group, "", kBody, now);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(refused.status().message(), HasSubstr("/epfabric.v1.Peer/Join: the certificate's CN"));
  // With a fabric secret too, the proof's rank must be one of the pod's.
  daemon::security::PeerAuthConfig both{"moe-0", kSecret, /*mutual_tls=*/true, /*insecure=*/false};
  both.ranks_per_pod = 2;
  daemon::security::PeerAuthenticator with_secret(both);
  EXPECT_TRUE(with_secret
                  .Check(kJoin, &worker_cn,
                         common::MakePeerProof(kSecret, "moe-0", kJoin, {PeerRole::kMember, 3}, kBody, now), kBody, now)
                  .ok());
  auto outside =
      with_secret.Check(kJoin, &worker_cn,
                        common::MakePeerProof(kSecret, "moe-0", kJoin, {PeerRole::kMember, 0}, kBody, now), kBody, now);
  EXPECT_THAT(outside.status().message(),
              HasSubstr("the certificate names member pod moe-0-1 (ranks 2-3) but the fabric credential names member "
                        "rank 0"));
}

TEST(PeerAuthenticator, AProofIsAcceptedOnceForTheRequestItWasMadeFor) {
  daemon::security::PeerAuthenticator auth({"fab", kSecret, /*mutual_tls=*/false, /*insecure=*/false});
  const absl::Time now = absl::Now();
  const std::string proof = common::MakePeerProof(kSecret, "fab", kJoin, {PeerRole::kMember, 2}, kBody, now);
  auto other_body = auth.Check(kJoin, nullptr, proof, "another request", now);
  EXPECT_EQ(other_body.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(other_body.status().message(), HasSubstr("made for another request"));
  auto first = auth.Check(kJoin, nullptr, proof, kBody, now);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->nonce.empty());
  auto replay = auth.Check(kJoin, nullptr, proof, kBody, now + absl::Seconds(1));
  EXPECT_EQ(replay.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(replay.status().message(), HasSubstr("used already"));
  // After the window the time check refuses it (the nonce need not be kept longer).
  auto late = auth.Check(kJoin, nullptr, proof, kBody, now + common::kPeerAuthMaxSkew + absl::Seconds(1));
  EXPECT_THAT(late.status().message(), HasSubstr("clock"));
}

TEST(PeerNonceCache, IsBoundedAndForgetsExpiredNonces) {
  common::PeerNonceCache cache(2);
  const absl::Time now = absl::Now();
  auto proof = [&](const std::string& nonce) { return common::VerifiedPeerProof{{}, nonce, now}; };
  EXPECT_TRUE(cache.Remember(kJoin, proof("a"), now).ok());
  EXPECT_TRUE(cache.Remember(kJoin, proof("b"), now).ok());
  EXPECT_EQ(cache.Remember(kJoin, proof("c"), now).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.Remember(kJoin, proof("a"), now).code(), absl::StatusCode::kUnauthenticated);
  const absl::Time later = now + common::kPeerAuthMaxSkew + absl::Seconds(1);
  EXPECT_TRUE(cache.Remember(kJoin, common::VerifiedPeerProof{{}, "c", later}, later).ok());
}

TEST(PeerReplyProof, BindsTheAnswerToTheServerSecretAndTheCallsNonce) {
  const std::string proof = common::MakePeerReplyProof(kSecret, "fab", kJoin, "nonce-1", "answer");
  EXPECT_TRUE(common::VerifyPeerReplyProof(kSecret, "fab", kJoin, "nonce-1", "answer", proof).ok());
  for (const absl::Status& refused : {
           common::VerifyPeerReplyProof(kSecret, "fab", kJoin, "nonce-1", "answer", ""),
           common::VerifyPeerReplyProof(kSecret, "fab", kJoin, "nonce-2", "answer", proof),
           common::VerifyPeerReplyProof(kSecret, "fab", kJoin, "nonce-1", "forged", proof),
           common::VerifyPeerReplyProof("another-secret-of-16+", "fab", kJoin, "nonce-1", "answer", proof),
       }) {
    EXPECT_EQ(refused.code(), absl::StatusCode::kUnauthenticated);
  }
}

TEST(PeerAuthenticator, InsecureModeAcceptsEveryCallUnauthenticated) {
  daemon::security::PeerAuthenticator auth({"fab", "", /*mutual_tls=*/false, /*insecure=*/true});
  auto anyone = auth.Check(kJoin, nullptr, "", kBody, absl::Now());
  ASSERT_TRUE(anyone.ok());
  EXPECT_FALSE(anyone->authenticated);
}

}  // namespace
}  // namespace epfabric
