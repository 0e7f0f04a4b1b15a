// Fuzzes every Peer method of a live fabric with mutated valid requests, sent with the credential the method needs
// (so that the handlers, not the authentication, see the garbage): ranks far out of range, epochs near 2^64, names of
// 10 KB, descriptor lists of the wrong length, unknown enum values. Afterwards every daemon is alive and answers.
// Time-boxed: EPF_FUZZ_SECONDS (default 8) per run; the sanitizer builds run it too.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"
#include "integration/fabric_test_util.h"
#include "integration/fabric_under_test.h"
#include "integration/peer_channel.h"
#include "integration/proto_mutator.h"

namespace epfabric::testing {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

TEST(PeerFuzz, MutatedRequestsToEveryMethodCrashNothing) {
  const char* env = std::getenv("EPF_FUZZ_SECONDS");
  const absl::Duration budget = absl::Seconds(env != nullptr ? std::atoi(env) : 8);
  auto fabric = FabricUnderTest::Start(3, {"--heartbeat_ms=100", "--heartbeat_misses=5"});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const std::string fabric_id = (*fabric)->fabric_id();
  v1::CreateGroupRequest create;
  create.set_name("g");
  for (int r : {0, 1, 2}) create.add_ranks(r);
  create.set_num_nvl_bytes(1 << 16);
  create.set_num_rdma_bytes(1 << 12);
  v1::CreateGroupResponse created;
  {
    grpc::ClientContext context;
    ASSERT_TRUE((*fabric)->Control(0)->CreateGroup(&context, create, &created).ok());
  }
  const v1::FabricView view = *(*fabric)->Fabric(0);
  std::vector<std::string> addresses;
  for (const auto& member : view.membership().members()) addresses.push_back(member.peer_address());
  const std::string secret = TestFabricSecret();

  // Valid seeds, one per method.
  v1::JoinRequest join;
  join.set_fabric_id(fabric_id);
  join.set_world_size(3);
  *join.mutable_member() = view.membership().members(1);
  join.set_known_epoch(view.membership().epoch());
  v1::GroupRecord* record = join.add_groups();
  *record->mutable_group() = view.groups(0);
  record->set_token_sha256(common::Sha256Hex(created.token()));
  record->set_deletion_key(common::HmacSha256Hex(created.token(), "epfabric retire v1"));
  v1::HeartbeatRequest beat;
  beat.set_fabric_id(fabric_id);
  beat.set_rank(1);
  beat.set_incarnation(view.membership().members(1).incarnation());
  beat.set_epoch(view.membership().epoch());
  v1::PublishMembershipRequest publish;
  publish.set_fabric_id(fabric_id);
  *publish.mutable_membership() = view.membership();
  v1::ProposeGroupRequest propose;
  propose.set_fabric_id(fabric_id);
  *propose.mutable_request() = create;
  propose.mutable_request()->set_name("h");
  v1::RetireGroupRequest retire;
  retire.set_fabric_id(fabric_id);
  retire.set_name("g");
  SetRetireProof(&retire, created.token());
  v1::PrepareGroupRequest prepare;
  prepare.set_fabric_id(fabric_id);
  *prepare.mutable_group() = view.groups(0);
  prepare.mutable_group()->set_name("p");
  SetGroupSecrets(&prepare, created.token());
  prepare.set_epoch(view.membership().epoch());
  v1::CommitGroupRequest commit;
  commit.set_fabric_id(fabric_id);
  commit.set_name("g");
  commit.set_epoch(view.membership().epoch());
  for (int i = 0; i < 3; ++i) commit.add_members();
  v1::ReleaseGroupRequest release;
  release.set_fabric_id(fabric_id);
  release.set_name("p");
  v1::NotifyLeaseRequest notify;
  notify.set_fabric_id(fabric_id);
  notify.set_sender_rank(1);
  notify.set_group("g");
  notify.set_group_rank(1);
  notify.set_sequence(1);

  Mutator mutator(0x5eed ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  std::map<std::string, int> sent;
  const absl::Time deadline = absl::Now() + budget;
  while (absl::Now() < deadline) {
    const int method = mutator.Pick(10);
    const int target = mutator.Pick(3);
    auto call = [&](auto seed, int claimed_rank, auto invoke, const char* name) {
      auto request = seed;
      for (int i = 1 + mutator.Pick(3); i > 0; --i) mutator.Mutate(&request);
      std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
      interceptors.push_back(common::MakePeerProofInterceptorFactory(
          secret, fabric_id, common::PeerProofClaim{common::PeerRole::kMember, claimed_rank},
          common::PeerAudience(addresses[target])));
      auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(
          addresses[target], grpc::InsecureChannelCredentials(), grpc::ChannelArguments(), std::move(interceptors));
      auto stub = v1::Peer::NewStub(channel);
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
      invoke(stub.get(), &context, request);
      ++sent[name];
    };
    switch (method) {
      case 0:
        call(
            join, 1,
            [](auto* s, auto* c, const auto& r) {
              v1::JoinResponse o;
              (void)s->Join(c, r, &o);
            },
            "Join");
        break;
      case 1:
        call(
            beat, 1,
            [](auto* s, auto* c, const auto& r) {
              v1::HeartbeatResponse o;
              (void)s->Heartbeat(c, r, &o);
            },
            "Heartbeat");
        break;
      case 2:
        call(
            publish, 0,
            [](auto* s, auto* c, const auto& r) {
              v1::PublishMembershipResponse o;
              (void)s->PublishMembership(c, r, &o);
            },
            "PublishMembership");
        break;
      case 3:
        call(
            propose, 1,
            [](auto* s, auto* c, const auto& r) {
              v1::CreateGroupResponse o;
              (void)s->ProposeGroup(c, r, &o);
            },
            "ProposeGroup");
        break;
      case 4:
        call(
            retire, 1,
            [](auto* s, auto* c, const auto& r) {
              v1::RetireGroupResponse o;
              (void)s->RetireGroup(c, r, &o);
            },
            "RetireGroup");
        break;
      case 5:
        call(
            prepare, 0,
            [](auto* s, auto* c, const auto& r) {
              v1::PrepareGroupResponse o;
              (void)s->PrepareGroup(c, r, &o);
            },
            "PrepareGroup");
        break;
      case 6:
        call(
            commit, 0,
            [](auto* s, auto* c, const auto& r) {
              v1::CommitGroupResponse o;
              (void)s->CommitGroup(c, r, &o);
            },
            "CommitGroup");
        break;
      case 7:
        call(
            release, 0,
            [](auto* s, auto* c, const auto& r) {
              v1::ReleaseGroupResponse o;
              (void)s->ReleaseGroup(c, r, &o);
            },
            "ReleaseGroup");
        break;
      case 8:
        call(
            notify, 1,
            [](auto* s, auto* c, const auto& r) {
              v1::NotifyLeaseResponse o;
              (void)s->NotifyLease(c, r, &o);
            },
            "NotifyLease");
        break;
      default:
        call(
            v1::BarrierRequest(), 1,
            [](auto* s, auto* c, const auto& r) {
              v1::BarrierResponse o;
              (void)s->Barrier(c, r, &o);
            },
            "Barrier");
        break;
    }
  }
  int total = 0;
  for (const auto& [name, count] : sent) total += count;
  std::cout << "[ FUZZ     ] " << total << " mutated peer requests in " << absl::FormatDuration(budget) << ":";
  for (const auto& [name, count] : sent) std::cout << " " << name << "=" << count;
  std::cout << "\n";
  // Every daemon survived and still answers on its client socket (membership may have been scrambled by the
  // coordinator-credential publishes: that is allowed to whoever holds rank 0's credential).
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE((*fabric)->daemon(rank).process().running()) << "rank " << rank << " died:\n"
                                                             << (*fabric)->daemon(rank).process().Stderr();
    EXPECT_TRUE((*fabric)->Fabric(rank).ok()) << "rank " << rank << " does not answer";
  }
  EXPECT_GT(total, 100);
}

// Proofs are bound to their request and their daemon and spent once (issue #34): a valid proof on a mutated body, a
// mutated proof on its own body, a proof sent twice and a proof made for another daemon are all refused
// (UNAUTHENTICATED), and every daemon survives.
TEST(PeerFuzz, MutatedProofsAndBodiesAreRefused) {
  const char* env = std::getenv("EPF_FUZZ_SECONDS");
  const absl::Duration budget = absl::Seconds(env != nullptr ? std::atoi(env) : 8) / 2;
  auto fabric = FabricUnderTest::Start(3, {"--heartbeat_ms=100", "--heartbeat_misses=5"});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const std::string fabric_id = (*fabric)->fabric_id();
  const v1::FabricView view = *(*fabric)->Fabric(0);
  const std::string secret = TestFabricSecret();
  constexpr char kRelease[] = "/epfabric.v1.Peer/ReleaseGroup";
  v1::ReleaseGroupRequest seed;
  seed.set_fabric_id(fabric_id);
  seed.set_name("absent");

  Mutator mutator(0x9f00f ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  int bodies = 0, proofs = 0, replays = 0, elsewhere = 0;
  const absl::Time deadline = absl::Now() + budget;
  while (absl::Now() < deadline) {
    const int target = 1 + mutator.Pick(2);
    const std::string address = view.membership().members(target).peer_address();
    const std::string other = view.membership().members(3 - target).peer_address();
    auto stub = v1::Peer::NewStub(PeerChannel(address, fabric_id, std::nullopt));
    v1::ReleaseGroupRequest request = seed;
    const int kind = mutator.Pick(4);
    // Kind 3: a good proof, made for the other member (as one captured there would be).
    std::string proof =
        common::MakePeerProof(secret, fabric_id, kRelease, {common::PeerRole::kMember, 0}, seed.SerializeAsString(),
                              absl::Now(), "", common::PeerAudience(kind == 3 ? other : address));
    if (kind == 3) ++elsewhere;
    if (kind == 0) {
      for (int i = 1 + mutator.Pick(3); i > 0; --i) mutator.Mutate(&request);
      if (request.SerializeAsString() == seed.SerializeAsString()) continue;
      ++bodies;
    } else if (kind == 1) {
      const std::string original = proof;
      switch (mutator.Pick(3)) {
        case 0:
          proof[mutator.Pick(static_cast<int>(proof.size()))] ^= static_cast<char>(1 + mutator.Pick(127));
          break;
        case 1:
          proof.resize(mutator.Pick(static_cast<int>(proof.size())));
          break;
        default:
          proof.insert(mutator.Pick(static_cast<int>(proof.size())), 1 + mutator.Pick(3), ':');
          break;
      }
      if (proof == original) continue;
      ++proofs;
    } else if (kind == 2) {
      // Once with its own body (accepted), then again.
      grpc::ClientContext first;
      first.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
      first.AddMetadata(common::kPeerAuthMetadataKey, proof);
      v1::ReleaseGroupResponse ignored;
      EXPECT_NE(stub->ReleaseGroup(&first, request, &ignored).error_code(), grpc::StatusCode::UNAUTHENTICATED);
      ++replays;
    }
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    // Metadata values must be printable: a mutation gRPC itself refuses to send proves nothing about the daemon.
    if (std::any_of(proof.begin(), proof.end(), [](char c) { return c < 0x20 || c > 0x7e; })) continue;
    context.AddMetadata(common::kPeerAuthMetadataKey, proof);
    v1::ReleaseGroupResponse response;
    const grpc::Status status = stub->ReleaseGroup(&context, request, &response);
    // A body that does not parse (a string field with invalid UTF-8) is refused by gRPC before any handler: INTERNAL.
    if (kind == 0 && status.error_code() == grpc::StatusCode::INTERNAL) continue;
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << "kind " << kind << ": " << status.error_message() << "\nproof " << proof << "\n"
        << request.DebugString();
  }
  std::cout << "[ FUZZ     ] " << bodies << " re-bodied proofs, " << proofs << " mutated proofs, " << replays
            << " replays, " << elsewhere << " proofs made for another daemon\n";
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE((*fabric)->daemon(rank).process().running()) << "rank " << rank << " died:\n"
                                                             << (*fabric)->daemon(rank).process().Stderr();
  }
  EXPECT_GT(bodies + proofs + replays, 10);
}

// NotifyLease (issue #14) speaks only for the rank the sender serves: a member claiming another member's rank, a
// rank outside the group or an unknown group are refused with the right code; the sender's own rank is accepted.
TEST(PeerNotifyLease, OnlyTheMemberServingTheRankMaySpeakForIt) {
  auto fabric = FabricUnderTest::Start(3, {"--heartbeat_ms=100", "--heartbeat_misses=5"});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const std::string fabric_id = (*fabric)->fabric_id();
  v1::CreateGroupResponse created;
  ASSERT_TRUE(CreateGroup(**fabric, 0, "g", {0, 1, 2}, 1 << 16, &created).ok());
  const v1::FabricView view = *(*fabric)->Fabric(0);
  auto notify = [&](int claimed_rank, int sender, const std::string& group, int group_rank) {
    auto stub = v1::Peer::NewStub(PeerChannel(view.membership().members(0).peer_address(), fabric_id,
                                              common::PeerProofClaim{common::PeerRole::kMember, claimed_rank}));
    v1::NotifyLeaseRequest request;
    request.set_fabric_id(fabric_id);
    request.set_sender_rank(sender);
    request.set_group(group);
    request.set_group_rank(group_rank);
    request.set_sequence(static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::NotifyLeaseResponse response;
    return stub->NotifyLease(&context, request, &response).error_code();
  };
  EXPECT_EQ(notify(1, 1, "g", 2), grpc::StatusCode::PERMISSION_DENIED) << "rank 2 is served by fabric rank 2";
  EXPECT_EQ(notify(1, 2, "g", 2), grpc::StatusCode::PERMISSION_DENIED) << "claims to be rank 1, says rank 2";
  EXPECT_EQ(notify(1, 1, "g", 7), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(notify(1, 1, "g", -1), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(notify(1, 1, "unknown", 1), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(notify(1, 1, "g", 1), grpc::StatusCode::OK);
}

}  // namespace
}  // namespace epfabric::testing
