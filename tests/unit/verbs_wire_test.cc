// The verbs wire's logic without a NIC (daemon/transport/verbs/verbs_logic.h): connection data and its checks,
// the registration path, the queue-pair attributes of each transition, completion errors, the --transport choice,
// and the probe's message on a machine without RDMA devices.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/verbs/verbs_logic.h"

namespace epfabric::daemon::transport::verbs {
namespace {

using ::testing::HasSubstr;

VerbsEndpoint Sample(bool roce) {
  VerbsEndpoint e;
  e.address = 0x7f0000001000;
  e.rkey = 0x1234;
  e.qp_numbers = {0, 0x11, 0x22, 0xffffff};
  e.psns = {0, 7, 8, 0xabcdef};
  for (int i = 0; i < 16; ++i) e.gid[i] = static_cast<uint8_t>(i + 1);
  e.lid = roce ? 0 : 42;
  e.mtu = IBV_MTU_2048;
  e.gid_index = 3;
  e.port = 2;
  e.roce = roce;
  return e;
}

TEST(VerbsEndpoint, RoundTripsThroughTheProto) {
  for (bool roce : {true, false}) {
    const VerbsEndpoint e = Sample(roce);
    const v1::RdmaEndpoint proto = ToProto(e, 5);
    EXPECT_EQ(proto.rank(), 5);
    auto back = FromProto(proto, 4);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->address, e.address);
    EXPECT_EQ(back->rkey, e.rkey);
    EXPECT_EQ(back->qp_numbers, e.qp_numbers);
    EXPECT_EQ(back->psns, e.psns);
    EXPECT_EQ(back->gid, e.gid);
    EXPECT_EQ(back->lid, e.lid);
    EXPECT_EQ(back->mtu, e.mtu);
    EXPECT_EQ(back->gid_index, e.gid_index);
    EXPECT_EQ(back->port, e.port);
    EXPECT_EQ(back->roce, e.roce);
  }
}

TEST(VerbsEndpoint, APeersBadEndpointIsRefusedNamingTheField) {
  const v1::RdmaEndpoint good = ToProto(Sample(true), 1);
  auto refused = [&](const std::function<void(v1::RdmaEndpoint&)>& mutate, size_t qps, const std::string& words) {
    v1::RdmaEndpoint bad = good;
    mutate(bad);
    auto parsed = FromProto(bad, qps);
    EXPECT_TRUE(absl::IsInvalidArgument(parsed.status())) << words;
    EXPECT_THAT(parsed.status().message(), HasSubstr(words));
  };
  refused([](v1::RdmaEndpoint&) {}, 5, "qp_numbers: 4 entries, expected 5");
  refused([](v1::RdmaEndpoint& e) { e.add_qp_numbers(1); }, 5, "psns: 4 entries, expected 5");
  refused([](v1::RdmaEndpoint& e) { e.set_gid("short"); }, 4, "gid: 5 bytes, expected 16");
  refused([](v1::RdmaEndpoint& e) { e.set_mtu(0); }, 4, "mtu: 0 is not an ibv_mtu");
  refused([](v1::RdmaEndpoint& e) { e.set_mtu(9); }, 4, "mtu: 9 is not an ibv_mtu");
  refused([](v1::RdmaEndpoint& e) { e.set_port(0); }, 4, "port: 0");
  refused([](v1::RdmaEndpoint& e) { e.set_qp_numbers(1, 1u << 24); }, 4, "over 24 bits");
  refused([](v1::RdmaEndpoint& e) { e.set_psns(2, 1u << 25); }, 4, "over 24 bits");
  refused(
      [](v1::RdmaEndpoint& e) {
        e.set_roce(false);
        e.set_lid(0);
      },
      4, "lid: 0");
}

TEST(RegistrationPath, FollowsWhatTheMemoryAndTheMachineAllow) {
  EXPECT_EQ(*ChooseRegistrationPath(false, false, false), RegistrationPath::kHostMemory);
  EXPECT_EQ(*ChooseRegistrationPath(false, true, true), RegistrationPath::kHostMemory);
  EXPECT_EQ(*ChooseRegistrationPath(true, true, false), RegistrationPath::kDmaBuf);
  EXPECT_EQ(*ChooseRegistrationPath(true, true, true), RegistrationPath::kDmaBuf) << "dma-buf is preferred";
  EXPECT_EQ(*ChooseRegistrationPath(true, false, true), RegistrationPath::kPeerMemory);
  auto none = ChooseRegistrationPath(true, false, false);
  EXPECT_TRUE(absl::IsFailedPrecondition(none.status()));
  EXPECT_THAT(none.status().message(), HasSubstr("nvidia-peermem"));
}

TEST(QpTransitions, InitAllowsRemoteWritesAndAtomics) {
  const QpTransition t = InitTransition(2);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(t.attr.port_num, 2);
  EXPECT_EQ(t.attr.pkey_index, 0);
  EXPECT_EQ(t.attr.qp_access_flags,
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_REMOTE_READ);
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

TEST(QpTransitions, RtrRoutesByGidOnRoceAndByLidOnInfiniBand) {
  const VerbsEndpoint roce = Sample(true);
  QpTransition t = RtrTransition(roce, 2, 7, IBV_MTU_4096);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_RTR);
  EXPECT_EQ(t.attr.path_mtu, IBV_MTU_2048) << "the smaller MTU of both sides";
  EXPECT_EQ(t.attr.dest_qp_num, 0x22u);
  EXPECT_EQ(t.attr.rq_psn, 8u);
  EXPECT_EQ(t.attr.max_dest_rd_atomic, 16);
  EXPECT_EQ(t.attr.min_rnr_timer, 12);
  EXPECT_EQ(t.attr.ah_attr.is_global, 1);
  EXPECT_EQ(t.attr.ah_attr.grh.sgid_index, 7);
  EXPECT_EQ(t.attr.ah_attr.grh.dgid.raw[0], 1);
  EXPECT_EQ(t.attr.ah_attr.grh.dgid.raw[15], 16);
  EXPECT_EQ(t.attr.ah_attr.port_num, 2);
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  const VerbsEndpoint ib = Sample(false);
  t = RtrTransition(ib, 1, 0, IBV_MTU_1024);
  EXPECT_EQ(t.attr.path_mtu, IBV_MTU_1024);
  EXPECT_EQ(t.attr.ah_attr.is_global, 0);
  EXPECT_EQ(t.attr.ah_attr.dlid, 42);
  EXPECT_EQ(t.attr.dest_qp_num, 0x11u);
}

TEST(QpTransitions, RtsRetriesBoundedAndAllowsAtomicsInFlight) {
  const QpTransition t = RtsTransition(0x123456);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(t.attr.sq_psn, 0x123456u);
  EXPECT_EQ(t.attr.timeout, 14);
  EXPECT_EQ(t.attr.retry_cnt, 7);
  EXPECT_EQ(t.attr.rnr_retry, 7);
  EXPECT_EQ(t.attr.max_rd_atomic, 16);
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_MAX_QP_RD_ATOMIC);
}

TEST(CompletionError, PeerFailuresAreUnavailableAndNameThePeer) {
  EXPECT_TRUE(CompletionError(IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, 3).ok());
  for (ibv_wc_status s : {IBV_WC_RETRY_EXC_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_WR_FLUSH_ERR, IBV_WC_REM_OP_ERR}) {
    const absl::Status status = CompletionError(s, IBV_WC_RDMA_WRITE, 3);
    EXPECT_TRUE(absl::IsUnavailable(status)) << ibv_wc_status_str(s);
    EXPECT_THAT(status.message(), HasSubstr("put to rank 3"));
    EXPECT_THAT(status.message(), HasSubstr(ibv_wc_status_str(s)));
  }
  const absl::Status local = CompletionError(IBV_WC_LOC_PROT_ERR, IBV_WC_FETCH_ADD, 1);
  EXPECT_TRUE(absl::IsInternal(local));
  EXPECT_THAT(local.message(), HasSubstr("signal_add to rank 1"));
}

TEST(Transport, AutoTakesVerbsOnlyWhenUsable) {
  EXPECT_EQ(ChooseTransport("auto", true), v1::TRANSPORT_VERBS);
  EXPECT_EQ(ChooseTransport("auto", false), v1::TRANSPORT_SOCKET);
  EXPECT_EQ(ChooseTransport("socket", true), v1::TRANSPORT_SOCKET);
  EXPECT_EQ(ChooseTransport("verbs", false), v1::TRANSPORT_VERBS);
}

TEST(Transport, ProbeWithoutADeviceSaysWhatIsMissing) {
  const absl::Status probe = ProbeVerbs();
  if (probe.ok()) GTEST_SKIP() << "this machine has an RDMA device with an active port";
  EXPECT_TRUE(absl::IsFailedPrecondition(probe));
  EXPECT_THAT(probe.message(), HasSubstr("--transport=verbs: no RDMA device"));
  EXPECT_EQ(std::string(probe.message()).find('\n'), std::string::npos) << "one line";
}

}  // namespace
}  // namespace epfabric::daemon::transport::verbs
