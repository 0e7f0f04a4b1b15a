// Helpers shared by the fabric integration tests (fabric_test.cc, group_recovery_test.cc): views, and the Control
// calls made through one daemon of a FabricUnderTest.
#pragma once

#include <string>
#include <vector>

#include "epfabric/v1/control.grpc.pb.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "integration/fabric_under_test.h"

namespace epfabric::testing {

inline bool AllUp(const v1::FabricView& view) {
  for (const auto& m : view.membership().members()) {
    if (m.state() != v1::MEMBER_STATE_UP) return false;
  }
  return true;
}

inline v1::MemberState StateOf(const v1::FabricView& view, int rank) { return view.membership().members(rank).state(); }

inline const v1::GroupInfo* FindGroup(const v1::FabricView& view, const std::string& name) {
  for (const auto& group : view.groups()) {
    if (group.name() == name) return &group;
  }
  return nullptr;
}

inline grpc::Status CreateGroup(FabricUnderTest& fabric, int via, const std::string& name, std::vector<int> ranks,
                                uint64_t nvl_bytes, v1::CreateGroupResponse* response, uint64_t rdma_bytes = 0) {
  v1::CreateGroupRequest request;
  request.set_name(name);
  for (int r : ranks) request.add_ranks(r);
  request.set_num_nvl_bytes(nvl_bytes);
  request.set_num_rdma_bytes(rdma_bytes);
  grpc::ClientContext context;
  return fabric.Control(via)->CreateGroup(&context, request, response);
}

inline grpc::Status DeleteGroup(FabricUnderTest& fabric, int via, const std::string& name, const std::string& token) {
  v1::DeleteGroupRequest request;
  request.set_name(name);
  request.set_token(token);
  grpc::ClientContext context;
  v1::DeleteGroupResponse response;
  return fabric.Control(via)->DeleteGroup(&context, request, &response);
}

inline grpc::Status Attach(FabricUnderTest& fabric, int via, const std::string& group, int rank,
                           const std::string& token, v1::AttachResponse* response) {
  v1::AttachRequest request;
  request.set_group(group);
  request.set_rank(rank);
  request.set_token(token);
  request.set_client_name("fabric_test");
  grpc::ClientContext context;
  return fabric.Control(via)->Attach(&context, request, response);
}

}  // namespace epfabric::testing
