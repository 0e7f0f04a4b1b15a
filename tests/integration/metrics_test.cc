// The Prometheus endpoint (--metrics_listen) of real daemons, scraped over HTTP after known traffic: names, types,
// labels and values; the same series through Ops.GetStats and `epctl stats`, and `epctl leases` / `epctl groups`.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/v1/fdchannel.pb.h"
#include "integration/fabric_under_test.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// One scrape: every sample by its series key (name{labels} exactly as exposed) and every family's type.
struct Scrape {
  int status = 0;
  std::string content_type;
  std::map<std::string, double> values;
  std::map<std::string, std::string> types;
  std::string text;

  double at(const std::string& key) const {
    auto it = values.find(key);
    EXPECT_NE(it, values.end()) << "no series " << key << " in\n" << text;
    return it == values.end() ? -1 : it->second;
  }
};

absl::StatusOr<std::string> MetricsAddress(FabricUnderTest& fabric, int rank) {
  grpc::ClientContext context;
  v1::Topology topology;
  const grpc::Status status = fabric.Ops(rank)->GetTopology(&context, v1::GetTopologyRequest(), &topology);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  return topology.daemon().metrics_address();
}

Scrape Get(const std::string& address, const std::string& path = "/metrics") {
  Scrape scrape;
  std::vector<std::string> host_port = absl::StrSplit(address, ':');
  int port = 0;
  EXPECT_TRUE(host_port.size() == 2 && absl::SimpleAtoi(host_port[1], &port)) << address;
  httplib::Client client(host_port[0], port);
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(5, 0);
  auto response = client.Get(path.c_str());
  if (!response) return scrape;
  scrape.status = response->status;
  scrape.content_type = response->get_header_value("Content-Type");
  scrape.text = response->body;
  for (absl::string_view line : absl::StrSplit(response->body, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      if (parts.size() == 2) scrape.types[parts[0]] = parts[1];
      continue;
    }
    if (line.front() == '#') continue;
    const size_t space = line.rfind(' ');
    double value = 0;
    EXPECT_TRUE(space != absl::string_view::npos && absl::SimpleAtod(line.substr(space + 1), &value)) << line;
    scrape.values[std::string(line.substr(0, space))] = value;
  }
  return scrape;
}

// Polls the scrape of `address` until `predicate` holds (or 10 s pass); returns the last one.
template <typename Predicate>
Scrape WaitScrape(const std::string& address, Predicate predicate) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  Scrape scrape = Get(address);
  while (!predicate(scrape) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    scrape = Get(address);
  }
  return scrape;
}

double Value(const Scrape& scrape, const std::string& key) {
  auto it = scrape.values.find(key);
  return it == scrape.values.end() ? -1 : it->second;
}

// A request on the fd side channel with a wrong token: refused.
void AskWithBadToken(const std::string& socket, const std::string& group) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = socket + ".fds";
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  v1::FdRequest request;
  request.set_group(group);
  request.set_rank(0);
  request.set_kind(v1::RegionDescriptor::KIND_NVL);
  request.set_token("00000000000000000000000000000000");
  ASSERT_TRUE(common::SendFds(fd, {}, request.SerializeAsString(), absl::Seconds(5)).ok());
  auto answer = common::ReceiveFds(fd, absl::Seconds(5));
  ASSERT_TRUE(answer.ok()) << answer.status();
  v1::FdResponse response;
  ASSERT_TRUE(response.ParseFromString(answer->payload));
  EXPECT_NE(response.code(), 0);
  close(fd);
}

TEST(Metrics, ScrapeAfterKnownTraffic) {
  auto fabric = FabricUnderTest::Start(
      2, {"--heartbeat_ms=100", "--heartbeat_misses=3", "--metrics_listen=127.0.0.1:0", "--log_format=json"});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  FabricUnderTest& f = **fabric;
  ASSERT_TRUE(f.WaitComplete().ok());
  auto address = MetricsAddress(f, 0);
  ASSERT_TRUE(address.ok()) << address.status();
  ASSERT_THAT(*address, ::testing::StartsWith("127.0.0.1:"));

  // Known traffic: a group of both ranks, one good and one refused Attach on rank 0, a refused fd-channel request.
  v1::CreateGroupRequest create;
  create.set_name("metrics-g");
  create.add_ranks(0);
  create.add_ranks(1);
  create.set_num_nvl_bytes(1 << 20);
  v1::CreateGroupResponse created;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(f.Control(0)->CreateGroup(&context, create, &created).ok());
  }
  v1::AttachRequest attach;
  attach.set_group("metrics-g");
  attach.set_rank(0);
  attach.set_token(created.token());
  attach.set_lease_ttl_ms(60000);
  {
    grpc::ClientContext context;
    v1::AttachResponse response;
    ASSERT_TRUE(f.Control(0)->Attach(&context, attach, &response).ok());
  }
  {
    attach.set_rank(1);  // rank 1 of the group through rank 0's daemon: not this daemon's rank
    attach.set_token("not-the-token");
    grpc::ClientContext context;
    v1::AttachResponse response;
    EXPECT_FALSE(f.Control(0)->Attach(&context, attach, &response).ok());
  }
  AskWithBadToken(f.daemon(0).socket(), "metrics-g");

  // Members beat every 100 ms: wait for the first beat to reach the coordinator.
  const std::string heartbeats =
      R"(epfabric_rpcs_total{listener="peer",service="epfabric.v1.Peer",method="Heartbeat",code="OK"})";
  Scrape scrape = WaitScrape(*address, [&](const Scrape& s) { return Value(s, heartbeats) > 0; });
  ASSERT_EQ(scrape.status, 200);
  EXPECT_THAT(scrape.content_type, HasSubstr("text/plain; version=0.0.4"));
  EXPECT_EQ(scrape.types["epfabric_rpcs_total"], "counter");
  EXPECT_EQ(scrape.types["epfabric_attach_duration_seconds"], "histogram");
  EXPECT_EQ(scrape.types["epfabric_fabric_members"], "gauge");
  EXPECT_EQ(scrape.types["epfabric_heartbeats_missed_total"], "counter");
  EXPECT_EQ(scrape.types["epfabric_fd_channel_refusals_total"], "counter");

  EXPECT_EQ(
      scrape.at(
          R"(epfabric_rpcs_total{listener="client",service="epfabric.v1.Control",method="CreateGroup",code="OK"})"),
      1);
  EXPECT_EQ(
      scrape.at(R"(epfabric_rpcs_total{listener="client",service="epfabric.v1.Control",method="Attach",code="OK"})"),
      1);
  double attach_errors = 0;
  for (const auto& [key, value] : scrape.values) {
    if (key.rfind(R"(epfabric_rpcs_total{listener="client",service="epfabric.v1.Control",method="Attach",code=")", 0) ==
            0 &&
        key.find(R"(code="OK")") == std::string::npos) {
      attach_errors += value;
    }
  }
  EXPECT_EQ(attach_errors, 1);
  EXPECT_EQ(scrape.at(R"(epfabric_attach_duration_seconds_count{code="OK"})"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_attach_duration_seconds_bucket{code="OK",le="+Inf"})"), 1);
  EXPECT_GT(scrape.at(R"(epfabric_attach_duration_seconds_sum{code="OK"})"), 0);
  // The coordinator's peer port serves the members' heartbeats and the group's prepare/commit.
  EXPECT_GT(scrape.at(heartbeats), 0);
  EXPECT_EQ(scrape.at(R"(epfabric_rpcs_total{listener="peer",service="epfabric.v1.Peer",method="Join",code="OK"})"), 1);

  EXPECT_EQ(scrape.at(R"(epfabric_fabric_members{state="up"})"), 2);
  EXPECT_EQ(scrape.at(R"(epfabric_fabric_members{state="down"})"), 0);
  EXPECT_EQ(scrape.at("epfabric_fabric_degraded"), 0);
  {
    auto view = f.Fabric(0);
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(scrape.at("epfabric_fabric_epoch"), static_cast<double>(view->membership().epoch()));
  }
  EXPECT_EQ(scrape.at(R"(epfabric_groups{state="ready"})"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_group_state{group="metrics-g",state="ready"})"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_region_bytes{group="metrics-g",kind="nvl"})"), 1 << 20);
  EXPECT_EQ(scrape.at(R"(epfabric_region_bytes{group="metrics-g",kind="rdma"})"), 0);
  EXPECT_EQ(scrape.at(R"(epfabric_leases{group="metrics-g"})"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_group_attached_ranks{group="metrics-g"})"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_fd_channel_refusals_total{what="request"})"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_fd_channel_refusals_total{what="connection"})"), 0);
  EXPECT_EQ(scrape.at(R"(epfabric_daemon_info{version=")" EPF_VERSION R"(",backend="host",fabric_id=")" +
                      f.fabric_id() + R"(",rank="0",world_size="2"})"),
            1);
  // Nothing secret: no token, no lease id.
  EXPECT_THAT(scrape.text, Not(HasSubstr(created.token())));
  EXPECT_EQ(Get(*address, "/not-metrics").status, 404);

  // Ops.GetStats: the same series; --group keeps the group's.
  {
    v1::GetStatsRequest request;
    request.set_group("metrics-g");
    v1::Stats stats;
    grpc::ClientContext context;
    ASSERT_TRUE(f.Ops(0)->GetStats(&context, request, &stats).ok());
    ASSERT_GT(stats.samples_size(), 0);
    for (const v1::MetricSample& sample : stats.samples()) {
      EXPECT_EQ(sample.labels().at("group"), "metrics-g") << sample.name();
    }
    EXPECT_EQ(stats.counters().at(R"(epfabric_leases{group="metrics-g"})"), 1u);
  }
  {
    RunResult leases = RunBinary({EpctlBinary(), "--socket=" + f.daemon(0).socket(), "leases"});
    EXPECT_EQ(leases.exit_code, 0) << leases.err;
    EXPECT_THAT(leases.out, HasSubstr(absl::StrCat(getuid())));
    EXPECT_THAT(leases.out, HasSubstr("metrics-g"));
    RunResult json = RunBinary({EpctlBinary(), "--socket=" + f.daemon(0).socket(), "--json", "leases"});
    EXPECT_EQ(json.exit_code, 0) << json.err;
    EXPECT_THAT(json.out, HasSubstr(absl::StrCat("\"pid\": \"", getpid(), "\"")));
    RunResult groups = RunBinary({EpctlBinary(), "--socket=" + f.daemon(0).socket(), "groups"});
    EXPECT_EQ(groups.exit_code, 0) << groups.err;
    EXPECT_THAT(groups.out, ::testing::ContainsRegex("metrics-g +READY +\\[0,1\\] +1048576"));
    RunResult stats = RunBinary({EpctlBinary(), "--socket=" + f.daemon(0).socket(), "stats", "--group=metrics-g"});
    EXPECT_EQ(stats.exit_code, 0) << stats.err;
    EXPECT_THAT(stats.out, ::testing::ContainsRegex("epfabric_leases group=metrics-g +1\n"));
    RunResult watch = RunBinary({EpctlBinary(), "--socket=" + f.daemon(0).socket(), "stats", "--watch",
                                 "--interval_ms=50", "--count=3", "--json"});
    EXPECT_EQ(watch.exit_code, 0) << watch.err;
    // Three reports, one JSON document each.
    const std::vector<std::string> reports = absl::StrSplit(watch.out, "\"uptime_seconds\"");
    EXPECT_EQ(reports.size(), 4u) << watch.out;
  }

  // A member dies: rank 0 counts it down, the group degrades, heartbeats were missed.
  f.Kill(1);
  scrape = WaitScrape(*address, [](const Scrape& s) {
    return Value(s, R"(epfabric_fabric_members{state="down"})") == 1 &&
           Value(s, R"(epfabric_group_state{group="metrics-g",state="degraded"})") == 1;
  });
  EXPECT_EQ(scrape.at(R"(epfabric_fabric_members{state="down"})"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_fabric_members{state="up"})"), 1);
  EXPECT_EQ(scrape.at("epfabric_fabric_degraded"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_member_down_events_total{rank="1"})"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_group_state{group="metrics-g",state="degraded"})"), 1);
  EXPECT_EQ(scrape.at(R"(epfabric_groups{state="degraded"})"), 1);
  EXPECT_GE(scrape.at("epfabric_heartbeats_missed_total"), 1);
}

TEST(Metrics, BadListenAddressStopsTheDaemonWithTheFlagNamed) {
  auto daemon = DaemonUnderTest::Start({"--metrics_listen=nonsense"});
  EXPECT_FALSE(daemon.ok());
  RunResult run = RunBinary({DaemonBinary(), "--client_socket=/tmp/unused-metrics.sock", "--insecure_peer_port",
                             "--metrics_listen=127.0.0.1:99999"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.err, HasSubstr("--metrics_listen"));
}

TEST(Metrics, NoEndpointWithoutTheFlag) {
  auto fabric = FabricUnderTest::Start(1);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  auto address = MetricsAddress(**fabric, 0);
  ASSERT_TRUE(address.ok());
  EXPECT_EQ(*address, "");
}

}  // namespace
}  // namespace epfabric::testing
