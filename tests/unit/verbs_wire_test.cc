// The verbs wire without a NIC: endpoint encoding and validation of peers' endpoints, device/port/GID choice,
// registration path choice, queue pair attributes of every transition, queue sizing, work completion errors, the
// start-up probe and the transport choice. The send-queue bookkeeping is in verbs_send_queue_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "transport/verbs/verbs_logic.h"
#include "transport/verbs/verbs_probe.h"
#include "transport/verbs/verbs_resources.h"
#include "transport/verbs/verbs_wire.h"

namespace epfabric::daemon::transport::verbs {
namespace {

using ::testing::HasSubstr;

Gid MakeGid(std::initializer_list<uint8_t> bytes) {
  Gid gid{};
  int i = 0;
  for (uint8_t b : bytes) gid[i++] = b;
  return gid;
}

Gid Ipv4Mapped(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
  return MakeGid({0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d});
}

// A RoCE endpoint of rank 2 in a group of 4 with 2 channels.
EndpointData RoceEndpoint() {
  EndpointData data;
  data.rank = 2;
  data.address = 0x7f0000001000;
  data.region_bytes = 1 << 20;
  data.rkey = 0xabcd;
  for (uint32_t i = 0; i < 8; ++i) {
    data.qp_numbers.push_back(0x100 + i);
    data.psns.push_back(0x500000 + i);
  }
  data.gid = Ipv4Mapped(10, 0, 0, 2);
  data.lid = 0;
  data.mtu = IBV_MTU_4096;
  data.gid_index = 3;
  data.port = 1;
  data.roce = true;
  return data;
}

constexpr EndpointExpectations kRoceExpect{2, 4, 2, true};

v1::TransportEndpoint Encoded(const EndpointData& data) {
  v1::TransportEndpoint endpoint;
  FillEndpoint(data, &endpoint);
  return endpoint;
}

TEST(VerbsEndpointTest, RoundTripsThroughTheProto) {
  const EndpointData data = RoceEndpoint();
  const v1::TransportEndpoint endpoint = Encoded(data);
  EXPECT_EQ(endpoint.transport(), v1::TRANSPORT_VERBS);
  EXPECT_EQ(endpoint.region_bytes(), data.region_bytes);
  EXPECT_EQ(endpoint.rdma().gid().size(), 16u);
  EXPECT_EQ(endpoint.rdma().mtu(), static_cast<uint32_t>(IBV_MTU_4096));

  absl::StatusOr<EndpointData> parsed = ParseEndpoint(endpoint, kRoceExpect);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->rank, data.rank);
  EXPECT_EQ(parsed->address, data.address);
  EXPECT_EQ(parsed->region_bytes, data.region_bytes);
  EXPECT_EQ(parsed->rkey, data.rkey);
  EXPECT_EQ(parsed->qp_numbers, data.qp_numbers);
  EXPECT_EQ(parsed->psns, data.psns);
  EXPECT_EQ(parsed->gid, data.gid);
  EXPECT_EQ(parsed->mtu, data.mtu);
  EXPECT_EQ(parsed->gid_index, data.gid_index);
  EXPECT_EQ(parsed->port, data.port);
  EXPECT_TRUE(parsed->roce);
}

TEST(VerbsEndpointTest, InfiniBandRoundTripKeepsTheLid) {
  EndpointData data = RoceEndpoint();
  data.roce = false;
  data.lid = 0x17;
  absl::StatusOr<EndpointData> parsed = ParseEndpoint(Encoded(data), EndpointExpectations{2, 4, 2, false});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->lid, 0x17);
  EXPECT_FALSE(parsed->roce);
}

// A peer's endpoint with one thing wrong must be refused with InvalidArgument naming that field.
struct BadEndpointCase {
  const char* name;
  void (*spoil)(v1::TransportEndpoint*);
  const char* field;
};

class VerbsBadEndpointTest : public ::testing::TestWithParam<BadEndpointCase> {};

TEST_P(VerbsBadEndpointTest, IsRefusedNamingTheField) {
  v1::TransportEndpoint endpoint = Encoded(RoceEndpoint());
  GetParam().spoil(&endpoint);
  absl::StatusOr<EndpointData> parsed = ParseEndpoint(endpoint, kRoceExpect);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << parsed.status();
  EXPECT_THAT(parsed.status().message(), HasSubstr(GetParam().field));
  EXPECT_THAT(parsed.status().message(), HasSubstr("rank 2"));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, VerbsBadEndpointTest,
    ::testing::Values(
        BadEndpointCase{"Transport", [](v1::TransportEndpoint* e) { e->set_transport(v1::TRANSPORT_SOCKET); },
                        "transport"},
        BadEndpointCase{"NoRdma", [](v1::TransportEndpoint* e) { e->clear_rdma(); }, "rdma"},
        BadEndpointCase{"Rank", [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_rank(1); }, "rdma.rank"},
        BadEndpointCase{"TooFewQps",
                        [](v1::TransportEndpoint* e) { e->mutable_rdma()->mutable_qp_numbers()->RemoveLast(); },
                        "rdma.qp_numbers has 7 entries, expected 8"},
        BadEndpointCase{"TooManyQps", [](v1::TransportEndpoint* e) { e->mutable_rdma()->add_qp_numbers(5); },
                        "rdma.qp_numbers has 9 entries"},
        BadEndpointCase{"TooFewPsns", [](v1::TransportEndpoint* e) { e->mutable_rdma()->mutable_psns()->RemoveLast(); },
                        "rdma.psns has 7 entries"},
        BadEndpointCase{"QpnOver24Bits",
                        [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_qp_numbers(3, 1u << 24); },
                        "rdma.qp_numbers[3]"},
        BadEndpointCase{"PsnOver24Bits", [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_psns(0, 0xFFFFFFFF); },
                        "rdma.psns[0]"},
        BadEndpointCase{"ShortGid", [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_gid("abcd"); },
                        "rdma.gid has 4 bytes, expected 16"},
        BadEndpointCase{"LongGid", [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_gid(std::string(17, 'x')); },
                        "rdma.gid has 17 bytes"},
        BadEndpointCase{"ZeroGidOnRoce",
                        [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_gid(std::string(16, '\0')); },
                        "rdma.gid is all zero"},
        BadEndpointCase{"MtuZero", [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_mtu(0); }, "rdma.mtu is 0"},
        BadEndpointCase{"MtuSix", [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_mtu(6); }, "rdma.mtu is 6"},
        BadEndpointCase{"PortZero", [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_port(0); }, "rdma.port"},
        BadEndpointCase{"GidIndex", [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_gid_index(256); },
                        "rdma.gid_index"},
        BadEndpointCase{"AddressWraps",
                        [](v1::TransportEndpoint* e) { e->mutable_rdma()->set_address(~uint64_t{0} - 100); },
                        "wraps around"}),
    [](const ::testing::TestParamInfo<BadEndpointCase>& info) { return std::string(info.param.name); });

TEST(VerbsEndpointTest, InfiniBandNeedsAUnicastLid) {
  EndpointData data = RoceEndpoint();
  data.roce = false;
  const EndpointExpectations ib{2, 4, 2, false};
  for (uint32_t lid : {0u, 0xC000u, 0xFFFFu, 0x10000u}) {
    v1::TransportEndpoint endpoint = Encoded(data);
    endpoint.mutable_rdma()->set_lid(lid);
    absl::StatusOr<EndpointData> parsed = ParseEndpoint(endpoint, ib);
    ASSERT_FALSE(parsed.ok()) << lid;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr("rdma.lid"));
  }
}

TEST(VerbsEndpointTest, LinkLayersMustMatch) {
  absl::StatusOr<EndpointData> parsed = ParseEndpoint(Encoded(RoceEndpoint()), EndpointExpectations{2, 4, 2, false});
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(parsed.status().message(), HasSubstr("rdma.roce"));
}

TEST(VerbsEndpointTest, ShapeMustBeSane) {
  EXPECT_EQ(ParseEndpoint(Encoded(RoceEndpoint()), EndpointExpectations{2, 0, 2, true}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEndpoint(Encoded(RoceEndpoint()), EndpointExpectations{2, 1 << 30, 8, true}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// --- Device, port and GID --------------------------------------------------------------------------------------

GidInfo Entry(uint32_t index, Gid gid, ibv_gid_type type) { return GidInfo{index, gid, type}; }

TEST(VerbsPortTest, RoceV2GidPrefersIpv4MappedThenGlobalThenLinkLocal) {
  const Gid link_local = MakeGid({0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8});
  const Gid global = MakeGid({0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1});
  const Gid v4 = Ipv4Mapped(192, 168, 1, 7);
  std::vector<GidInfo> gids = {Entry(0, link_local, IBV_GID_TYPE_ROCE_V1), Entry(1, link_local, IBV_GID_TYPE_ROCE_V2),
                               Entry(2, v4, IBV_GID_TYPE_ROCE_V1),         Entry(3, Gid{}, IBV_GID_TYPE_ROCE_V2),
                               Entry(4, global, IBV_GID_TYPE_ROCE_V2),     Entry(5, v4, IBV_GID_TYPE_ROCE_V2)};
  std::optional<GidInfo> chosen = ChooseRoceV2Gid(gids);
  ASSERT_TRUE(chosen.has_value());
  EXPECT_EQ(chosen->index, 5u);
  gids.pop_back();
  EXPECT_EQ(ChooseRoceV2Gid(gids)->index, 4u);
  gids.pop_back();
  EXPECT_EQ(ChooseRoceV2Gid(gids)->index, 1u);
  gids.erase(gids.begin() + 1);
  EXPECT_FALSE(ChooseRoceV2Gid(gids).has_value());  // only RoCE v1 and an all-zero entry left
}

PortInfo RocePort(uint8_t number, bool active) {
  PortInfo port;
  port.port = number;
  port.active = active;
  port.ethernet = true;
  port.active_mtu = IBV_MTU_4096;
  port.gids = {Entry(0, MakeGid({0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1}), IBV_GID_TYPE_ROCE_V1),
               Entry(3, Ipv4Mapped(10, 1, 1, number), IBV_GID_TYPE_ROCE_V2)};
  return port;
}

PortInfo IbPort(uint8_t number, uint16_t lid) {
  PortInfo port;
  port.port = number;
  port.active = true;
  port.active_mtu = IBV_MTU_4096;
  port.lid = lid;
  port.gids = {Entry(0, MakeGid({0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0xaa}), IBV_GID_TYPE_IB)};
  return port;
}

TEST(VerbsPortTest, NoDeviceSaysSoInOneLine) {
  absl::StatusOr<PortChoice> choice = ChoosePort(VerbsOptions{}, {});
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(choice.status().message(), "--transport=verbs: no RDMA device (ibv_get_device_list found none)");
}

TEST(VerbsPortTest, NamedDeviceMissingListsTheOthers) {
  VerbsOptions options;
  options.device = "mlx5_9";
  absl::StatusOr<PortChoice> choice = ChoosePort(options, {DeviceInfo{"mlx5_0", {}}, DeviceInfo{"mlx5_1", {}}});
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().message(), "--transport=verbs: no RDMA device named mlx5_9 (found mlx5_0, mlx5_1)");
}

TEST(VerbsPortTest, DeviceWithoutActivePort) {
  VerbsOptions options;
  options.device = "mlx5_0";
  absl::StatusOr<PortChoice> choice = ChoosePort(options, {DeviceInfo{"mlx5_0", {RocePort(1, false)}}});
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(choice.status().message(), "--transport=verbs: device mlx5_0 has no active port");
  options.port = 2;
  EXPECT_EQ(ChoosePort(options, {DeviceInfo{"mlx5_0", {RocePort(1, true), RocePort(2, false)}}}).status().message(),
            "--transport=verbs: device mlx5_0 port 2 is not active");
}

TEST(VerbsPortTest, FirstDeviceWithAnActivePortWins) {
  absl::StatusOr<PortChoice> choice = ChoosePort(
      VerbsOptions{},
      {DeviceInfo{"mlx5_0", {RocePort(1, false)}}, DeviceInfo{"mlx5_1", {RocePort(1, false), RocePort(2, true)}}});
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->device, "mlx5_1");
  EXPECT_EQ(choice->port, 2);
  EXPECT_TRUE(choice->roce);
  EXPECT_EQ(choice->gid_index, 3u);
  EXPECT_EQ(choice->gid, Ipv4Mapped(10, 1, 1, 2));
  EXPECT_EQ(choice->mtu, IBV_MTU_4096);
  EXPECT_EQ(DescribePort(*choice), "mlx5_1 port 2 (RoCE v2, gid index 3)");
}

TEST(VerbsPortTest, RocePortWithoutRoceV2Gid) {
  PortInfo port = RocePort(1, true);
  port.gids.pop_back();
  absl::StatusOr<PortChoice> choice = ChoosePort(VerbsOptions{}, {DeviceInfo{"mlx5_0", {port}}});
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(choice.status().message(), HasSubstr("mlx5_0 port 1 has no RoCE v2 GID"));
}

TEST(VerbsPortTest, ExplicitGidIndexMustExistAndBeRoceV2) {
  VerbsOptions options;
  options.gid_index = 0;  // RoCE v1 on this port
  EXPECT_THAT(ChoosePort(options, {DeviceInfo{"mlx5_0", {RocePort(1, true)}}}).status().message(),
              HasSubstr("GID index 0 is not RoCE v2"));
  options.gid_index = 7;
  EXPECT_THAT(ChoosePort(options, {DeviceInfo{"mlx5_0", {RocePort(1, true)}}}).status().message(),
              HasSubstr("has no GID at index 7"));
  options.gid_index = 3;
  absl::StatusOr<PortChoice> choice = ChoosePort(options, {DeviceInfo{"mlx5_0", {RocePort(1, true)}}});
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->gid_index, 3u);
}

TEST(VerbsPortTest, InfiniBandRoutesByLid) {
  absl::StatusOr<PortChoice> choice = ChoosePort(VerbsOptions{}, {DeviceInfo{"mlx5_2", {IbPort(1, 42)}}});
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_FALSE(choice->roce);
  EXPECT_EQ(choice->lid, 42);
  EXPECT_EQ(choice->gid_index, 0u);
  EXPECT_EQ(DescribePort(*choice), "mlx5_2 port 1 (InfiniBand, lid 42)");
  EXPECT_THAT(ChoosePort(VerbsOptions{}, {DeviceInfo{"mlx5_2", {IbPort(1, 0)}}}).status().message(),
              HasSubstr("has no LID"));
}

// --- Registration ----------------------------------------------------------------------------------------------

TEST(VerbsRegistrationTest, PathIsAFunctionOfCapabilities) {
  using P = RegistrationPath;
  EXPECT_EQ(RegistrationOrder({false, false, true}), std::vector<P>{P::kHostRegMr});
  EXPECT_EQ(RegistrationOrder({false, true, false}), std::vector<P>{P::kHostRegMr});  // host memory: never DMA-BUF
  EXPECT_EQ(RegistrationOrder({true, true, true}), (std::vector<P>{P::kDmaBuf, P::kPeerMemRegMr}));
  EXPECT_EQ(RegistrationOrder({true, true, false}), std::vector<P>{P::kDmaBuf});
  EXPECT_EQ(RegistrationOrder({true, false, true}), std::vector<P>{P::kPeerMemRegMr});
  EXPECT_TRUE(RegistrationOrder({true, false, false}).empty());
  EXPECT_THAT(std::string(RegistrationPathName(P::kDmaBuf)), HasSubstr("ibv_reg_dmabuf_mr"));
}

TEST(VerbsRegistrationTest, DmaBufRangeIsPageAligned) {
  DmaBufRange range = DmaBufRangeFor(0x7f0000200000, 1 << 21, 4096);
  EXPECT_EQ(range.start, 0x7f0000200000u);
  EXPECT_EQ(range.offset, 0u);
  EXPECT_EQ(range.size, 1u << 21);
  range = DmaBufRangeFor(0x10000100, 5000, 4096);
  EXPECT_EQ(range.start, 0x10000000u);
  EXPECT_EQ(range.offset, 0x100u);
  EXPECT_EQ(range.size, 8192u);  // 0x100 + 5000 = 5256 -> two pages
}

// --- Queue pair transitions --------------------------------------------------------------------------------------

constexpr int kAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_REMOTE_READ;

TEST(VerbsQpTest, InitAllowsWriteReadAtomics) {
  QpTransition t = InitTransition(2);
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(t.attr.port_num, 2);
  EXPECT_EQ(t.attr.pkey_index, 0);
  EXPECT_EQ(t.attr.qp_access_flags, static_cast<unsigned>(kAccess));
  EXPECT_EQ(kRegionAccess & IBV_ACCESS_RELAXED_ORDERING, 0);
}

constexpr int kRtrMask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                         IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;

TEST(VerbsQpTest, RtrOnRoceRoutesByGid) {
  PortChoice local;
  local.device = "mlx5_0";
  local.port = 1;
  local.roce = true;
  local.gid_index = 3;
  local.mtu = IBV_MTU_4096;
  EndpointData remote = RoceEndpoint();
  remote.mtu = IBV_MTU_1024;  // the smaller MTU wins
  VerbsOptions options;
  options.traffic_class = 106;
  options.hop_limit = 64;
  options.service_level = 3;
  QpTransition t = RtrTransition(local, remote, 0x123456, 0xabcdef, options, 16);
  EXPECT_EQ(t.mask, kRtrMask);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_RTR);
  EXPECT_EQ(t.attr.path_mtu, IBV_MTU_1024);
  EXPECT_EQ(t.attr.dest_qp_num, 0x123456u);
  EXPECT_EQ(t.attr.rq_psn, 0xabcdefu);
  EXPECT_EQ(t.attr.max_dest_rd_atomic, 16);
  EXPECT_EQ(t.attr.min_rnr_timer, 12);
  EXPECT_EQ(t.attr.ah_attr.is_global, 1);
  EXPECT_EQ(t.attr.ah_attr.port_num, 1);
  EXPECT_EQ(t.attr.ah_attr.sl, 3);
  EXPECT_EQ(t.attr.ah_attr.dlid, 0);
  EXPECT_EQ(std::memcmp(t.attr.ah_attr.grh.dgid.raw, remote.gid.data(), 16), 0);
  EXPECT_EQ(t.attr.ah_attr.grh.sgid_index, 3);
  EXPECT_EQ(t.attr.ah_attr.grh.hop_limit, 64);
  EXPECT_EQ(t.attr.ah_attr.grh.traffic_class, 106);
}

TEST(VerbsQpTest, RtrOnInfiniBandRoutesByLid) {
  PortChoice local;
  local.port = 1;
  local.roce = false;
  local.lid = 5;
  local.mtu = IBV_MTU_2048;
  EndpointData remote = RoceEndpoint();
  remote.roce = false;
  remote.lid = 0x2a;
  remote.mtu = IBV_MTU_4096;
  QpTransition t = RtrTransition(local, remote, 77, 99, VerbsOptions{}, 300);
  EXPECT_EQ(t.mask, kRtrMask);
  EXPECT_EQ(t.attr.path_mtu, IBV_MTU_2048);
  EXPECT_EQ(t.attr.ah_attr.is_global, 0);
  EXPECT_EQ(t.attr.ah_attr.dlid, 0x2a);
  EXPECT_EQ(t.attr.dest_qp_num, 77u);
  EXPECT_EQ(t.attr.rq_psn, 99u);
  EXPECT_EQ(t.attr.max_dest_rd_atomic, 255);  // clamped to the 8-bit field
}

TEST(VerbsQpTest, RtsSetsRetriesAndSendPsn) {
  VerbsOptions options;
  QpTransition t = RtsTransition(0x1abcdef, options, 8);
  EXPECT_EQ(t.mask, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC);
  EXPECT_EQ(t.attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(t.attr.timeout, 20);
  EXPECT_EQ(t.attr.retry_cnt, 7);
  EXPECT_EQ(t.attr.rnr_retry, 7);
  EXPECT_EQ(t.attr.sq_psn, 0xabcdefu);  // 24 bits
  EXPECT_EQ(t.attr.max_rd_atomic, 8);
  EXPECT_EQ(RtsTransition(1, options, 0).attr.max_rd_atomic, 1);
}

TEST(VerbsQpTest, QueueSizesFitTheDevice) {
  absl::StatusOr<QueueSizes> sizes = SizeQueues(8, 512, 32768, 4194303);
  ASSERT_TRUE(sizes.ok());
  EXPECT_EQ(sizes->send_queue_depth, 512);
  EXPECT_EQ(sizes->cq_entries, 4096);
  sizes = SizeQueues(8, 512, 256, 4194303);
  EXPECT_EQ(sizes->send_queue_depth, 256);  // max_qp_wr
  sizes = SizeQueues(1024, 512, 32768, 65536);
  EXPECT_EQ(sizes->send_queue_depth, 64);  // max_cqe / queue pairs
  EXPECT_EQ(sizes->cq_entries, 65536);
  EXPECT_EQ(SizeQueues(100, 512, 32768, 50).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(SizeQueues(0, 512, 32768, 50).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SizeQueues(8, 0, 32768, 50).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(VerbsQpTest, LongPutsAreSplit) {
  EXPECT_EQ(MaxWriteBytes(0x80000000u), uint64_t{1} << 30);
  EXPECT_EQ(MaxWriteBytes(1 << 20), uint64_t{1} << 20);
  EXPECT_EQ(MaxWriteBytes(0), uint64_t{1} << 30);
  EXPECT_EQ(WriteCount(0, 1 << 20), 1u);
  EXPECT_EQ(WriteCount(1, 1 << 20), 1u);
  EXPECT_EQ(WriteCount(1 << 20, 1 << 20), 1u);
  EXPECT_EQ(WriteCount((1 << 20) + 1, 1 << 20), 2u);
  EXPECT_EQ(WriteCount(uint64_t{5} << 30, uint64_t{1} << 30), 5u);
}

// --- Completions -------------------------------------------------------------------------------------------------

TEST(VerbsCompletionTest, WcStatusMapsToCodes) {
  EXPECT_EQ(CodeForWcStatus(IBV_WC_SUCCESS), absl::StatusCode::kOk);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_RETRY_EXC_ERR), absl::StatusCode::kUnavailable);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_RNR_RETRY_EXC_ERR), absl::StatusCode::kUnavailable);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_WR_FLUSH_ERR), absl::StatusCode::kUnavailable);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_REM_ABORT_ERR), absl::StatusCode::kUnavailable);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_REM_ACCESS_ERR), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_LOC_PROT_ERR), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_LOC_LEN_ERR), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_REM_INV_REQ_ERR), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_FATAL_ERR), absl::StatusCode::kInternal);
  EXPECT_EQ(CodeForWcStatus(IBV_WC_GENERAL_ERR), absl::StatusCode::kInternal);
}

TEST(VerbsCompletionTest, StatusNamesGroupPeerChannelAndVerbsText) {
  EXPECT_TRUE(WcStatusToStatus(IBV_WC_SUCCESS, 0, "g", 1, 0, "RDMA WRITE").ok());
  absl::Status status = WcStatusToStatus(IBV_WC_RETRY_EXC_ERR, 0x81, "moe", 3, 1, "RDMA WRITE");
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.message(), HasSubstr("group moe, rank 3, channel 1"));
  EXPECT_THAT(status.message(), HasSubstr(ibv_wc_status_str(IBV_WC_RETRY_EXC_ERR)));
  EXPECT_THAT(status.message(), HasSubstr("vendor error 0x81"));
}

TEST(VerbsCompletionTest, ErrnoMapsToCodes) {
  EXPECT_EQ(ErrnoStatus(ETIMEDOUT, "x").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoStatus(-ENOMEM, "x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(EOPNOTSUPP, "x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrnoStatus(EINVAL, "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ErrnoStatus(EFAULT, "ibv_reg_mr").message(), HasSubstr("verbs: ibv_reg_mr: "));
}

// --- Probe and transport choice -----------------------------------------------------------------------------------

TEST(VerbsProbeTest, ChooseTransport) {
  EXPECT_EQ(ChooseTransport("socket", true), v1::TRANSPORT_SOCKET);
  EXPECT_EQ(ChooseTransport("socket", false), v1::TRANSPORT_SOCKET);
  EXPECT_EQ(ChooseTransport("verbs", true), v1::TRANSPORT_VERBS);
  EXPECT_EQ(ChooseTransport("verbs", false), v1::TRANSPORT_VERBS);  // no silent fallback: the daemon exits 2
  EXPECT_EQ(ChooseTransport("auto", true), v1::TRANSPORT_VERBS);
  EXPECT_EQ(ChooseTransport("auto", false), v1::TRANSPORT_SOCKET);
  EXPECT_EQ(ChooseTransport("", true), v1::TRANSPORT_UNSPECIFIED);
  EXPECT_EQ(ChooseTransport("rdma", true), v1::TRANSPORT_UNSPECIFIED);
}

TEST(VerbsProbeTest, WithoutADeviceTheProbeSaysWhatIsMissing) {
  if (!ListDevices().empty()) GTEST_SKIP() << "this machine has an RDMA device";
  const absl::Status status = ProbeVerbs(VerbsOptions{});
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(), "--transport=verbs: no RDMA device (ibv_get_device_list found none)");
  EXPECT_EQ(status.message().find('\n'), absl::string_view::npos);
  absl::StatusOr<std::unique_ptr<Wire>> wire = MakeVerbsWire(VerbsOptions{});
  ASSERT_FALSE(wire.ok());
  EXPECT_EQ(wire.status(), status);
}

TEST(VerbsProbeTest, HostMemoryCanAlwaysBeRegistered) {
  EXPECT_TRUE(CanRegister(-1).ok());
  const absl::Status gpu = CanRegister(0);
  if (!gpu.ok()) {
    EXPECT_EQ(gpu.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(gpu.message(), HasSubstr("GPU 0"));
  }
}

}  // namespace
}  // namespace epfabric::daemon::transport::verbs
