// Calling every member of a group at once: the coordinator's Prepare, Commit and Release phases.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "fabric/peer_links.h"

namespace epfabric::daemon::groups {

// How long the coordinator waits for a member's answer, and a forwarding daemon for the coordinator's.
inline constexpr absl::Duration kPeerCallDeadline = absl::Seconds(30);
// NotifyLease (fire and forget): a member that does not answer within this time misses one lease change.
inline constexpr absl::Duration kNotifyLeaseDeadline = absl::Seconds(2);
// A notification sent again (LeaseNotificationRetries), as long as the first: a starved member (sanitizers, two
// cores) answers late.
inline constexpr absl::Duration kNotifyLeaseRetryDeadline = absl::Seconds(2);
// A member releases a group it prepared if no Commit came within this time (the coordinator gave up or died).
inline constexpr absl::Duration kUncommittedLifetime = absl::Seconds(60);

// One member's answer to a fan-out call.
template <typename Response>
struct MemberReply {
  bool called = false;  // false: the member was skipped (no address), `status` is OK
  grpc::Status status;
  Response response;
};

// Starts one asynchronous Peer RPC on `stub`; `done` must be called exactly once (gRPC's callback API does), e.g.
//   [](v1::Peer::Stub* stub, grpc::ClientContext* context, const v1::CommitGroupRequest* request,
//      v1::CommitGroupResponse* response, std::function<void(grpc::Status)> done) {
//     stub->async()->CommitGroup(context, request, response, std::move(done));
//   }
template <typename Request, typename Response>
using StartPeerCall = void (*)(v1::Peer::Stub* stub, grpc::ClientContext* context, const Request* request,
                               Response* response, std::function<void(grpc::Status)> done);

// Sends `request` to the peer server at every address at once (an empty address is skipped), each call with
// `deadline` (default: kPeerCallDeadline from now), and waits for every answer. The replies are in the order of
// `addresses`. Call it without holding any lock: it waits on other daemons. With `proven_method` (the call's full
// gRPC method name), an OK answer counts only with its server's proof (PeerLinks::VerifyAnswer; a fabric secret
// configured): one without becomes UNAUTHENTICATED, as from whoever holds a dead member's port.
template <typename Request, typename Response>
std::vector<MemberReply<Response>> CallMembers(fabric::PeerLinks& links, const std::vector<std::string>& addresses,
                                               const Request& request, StartPeerCall<Request, Response> start,
                                               absl::Time deadline = absl::InfiniteFuture(),
                                               const char* proven_method = nullptr) {
  if (deadline == absl::InfiniteFuture()) deadline = absl::Now() + kPeerCallDeadline;
  const size_t count = addresses.size();
  std::vector<MemberReply<Response>> replies(count);
  if (count == 0) return replies;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(count);
  std::vector<std::shared_ptr<v1::Peer::Stub>> stubs(count);
  std::vector<std::string> nonces(count);
  absl::BlockingCounter pending(static_cast<int>(count));
  for (size_t i = 0; i < count; ++i) {
    if (addresses[i].empty()) {
      pending.DecrementCount();
      continue;
    }
    replies[i].called = true;
    contexts[i] = std::make_unique<grpc::ClientContext>();
    contexts[i]->set_deadline(absl::ToChronoTime(deadline));
    if (proven_method != nullptr) nonces[i] = links.ExpectProof(*contexts[i]);
    stubs[i] = links.Stub(addresses[i]);
    start(stubs[i].get(), contexts[i].get(), &request, &replies[i].response,
          [&replies, &pending, i](grpc::Status status) {
            replies[i].status = std::move(status);
            pending.DecrementCount();
          });
  }
  pending.Wait();  // the contexts and stubs outlive every call
  for (size_t i = 0; i < count && proven_method != nullptr; ++i) {
    if (!replies[i].called || !replies[i].status.ok()) continue;
    if (absl::Status proven = links.VerifyAnswer(*contexts[i], nonces[i], proven_method, replies[i].response);
        !proven.ok()) {
      replies[i].status =
          grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                       absl::StrCat(addresses[i], " answered without the fabric's proof: ", proven.message()));
    }
  }
  return replies;
}

}  // namespace epfabric::daemon::groups
