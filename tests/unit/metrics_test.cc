// The metrics registry and its text exposition (daemon/metrics/registry.h), and the JSON log formatter.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "logging.h"
#include "metrics/daemon_metrics.h"
#include "metrics/registry.h"
#include "spdlog/sinks/ostream_sink.h"

namespace epfabric::daemon::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(Registry, CountersAndHistogramsInTextFormat) {
  Registry registry;
  CounterVec calls;
  HistogramVec latency;
  ASSERT_TRUE(registry.AddCounter("epf_calls_total", "Calls.\nSecond line \\ end", {"method", "code"}, &calls).ok());
  ASSERT_TRUE(registry.AddHistogram("epf_latency_seconds", "Latency", {"code"}, {0.001, 0.01}, &latency).ok());
  calls.Increment({"Attach", "OK"});
  calls.Increment({"Attach", "OK"}, 2);
  calls.Increment({"Attach", "NOT_FOUND"});
  calls.Increment({"Attach", "OK"}, -5);  // counters never go down
  latency.Observe({"OK"}, 0.0005);
  latency.Observe({"OK"}, 0.001);  // on the bound: counted in that bucket (le)
  latency.Observe({"OK"}, 0.5);
  EXPECT_EQ(calls.Value({"Attach", "OK"}), 3);

  const std::string text = Exposition(registry.Collect());
  EXPECT_EQ(text,
            "# HELP epf_calls_total Calls.\\nSecond line \\\\ end\n"
            "# TYPE epf_calls_total counter\n"
            "epf_calls_total{method=\"Attach\",code=\"NOT_FOUND\"} 1\n"
            "epf_calls_total{method=\"Attach\",code=\"OK\"} 3\n"
            "# HELP epf_latency_seconds Latency\n"
            "# TYPE epf_latency_seconds histogram\n"
            "epf_latency_seconds_bucket{code=\"OK\",le=\"0.001\"} 2\n"
            "epf_latency_seconds_bucket{code=\"OK\",le=\"0.01\"} 2\n"
            "epf_latency_seconds_bucket{code=\"OK\",le=\"+Inf\"} 3\n"
            "epf_latency_seconds_sum{code=\"OK\"} 0.5015\n"
            "epf_latency_seconds_count{code=\"OK\"} 3\n");
}

TEST(Registry, CollectorsAndEscaping) {
  Registry registry;
  registry.AddCollector([] {
    std::vector<Family> families;
    families.push_back(FamilyBuilder("epf_bytes", "Bytes").Add({{"group", "a\"b\\c\nd"}}, 1099511627776.0).Build());
    return families;
  });
  EXPECT_EQ(Exposition(registry.Collect()),
            "# HELP epf_bytes Bytes\n# TYPE epf_bytes gauge\nepf_bytes{group=\"a\\\"b\\\\c\\nd\"} 1099511627776\n");
}

TEST(Registry, RefusesBadOrRepeatedNames) {
  Registry registry;
  CounterVec counter;
  HistogramVec histogram;
  EXPECT_FALSE(registry.AddCounter("1bad", "", {}, &counter).ok());
  EXPECT_FALSE(registry.AddCounter("ok_total", "", {"bad-label"}, &counter).ok());
  EXPECT_FALSE(registry.AddCounter("ok_total", "", {"a", "a"}, &counter).ok());
  EXPECT_FALSE(registry.AddCounter("ok_total", "", {"__reserved"}, &counter).ok());
  EXPECT_FALSE(registry.AddHistogram("h", "", {"le"}, {1}, &histogram).ok());
  EXPECT_FALSE(registry.AddHistogram("h", "", {}, {2, 1}, &histogram).ok());
  ASSERT_TRUE(registry.AddCounter("ok_total", "", {}, &counter).ok());
  EXPECT_FALSE(registry.AddCounter("ok_total", "", {}, &counter).ok());
  EXPECT_TRUE(ValidMetricName("epfabric:rate_5m"));
  EXPECT_FALSE(ValidLabelName("a:b"));
}

TEST(DaemonMetrics, UnknownMethodsDoNotCreateSeriesAndGroupFilterKeepsOneGroup) {
  DaemonMetrics metrics([] {
    DaemonSnapshot snapshot;
    snapshot.info.set_rank(0);
    v1::GroupInfo* a = snapshot.fabric.add_groups();
    a->set_name("a");
    a->add_ranks(0);
    a->set_num_nvl_bytes(4096);
    a->set_state(v1::GROUP_STATE_READY);
    v1::GroupInfo* b = snapshot.fabric.add_groups();
    b->set_name("b");
    b->add_ranks(1);  // registered here, held elsewhere: no region bytes
    b->set_state(v1::GROUP_STATE_DEGRADED);
    return snapshot;
  });
  metrics.RecordRpc("client", "/epfabric.v1.Control/Attach", 0, absl::Milliseconds(2));
  metrics.RecordRpc("client", "/made.up.Service/Anything", 12, absl::Milliseconds(1));
  metrics.RecordRpc("client", "/epfabric.v1.Control/NoSuchMethod", 12, absl::Milliseconds(1));
  const std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("epfabric_rpcs_total{listener=\"client\",service=\"epfabric.v1.Control\","
                              "method=\"Attach\",code=\"OK\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("epfabric_rpcs_total{listener=\"client\",service=\"unknown\",method=\"unknown\","
                              "code=\"UNIMPLEMENTED\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("epfabric_attach_duration_seconds_bucket{code=\"OK\",le=\"0.0025\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("epfabric_region_bytes{group=\"a\",kind=\"nvl\"} 4096\n"));
  EXPECT_THAT(text, Not(HasSubstr("epfabric_region_bytes{group=\"b\"")));
  EXPECT_THAT(text, HasSubstr("epfabric_groups{state=\"degraded\"} 1\n"));

  v1::GetStatsRequest request;
  request.set_group("a");
  const v1::Stats stats = metrics.Stats(request, 5);
  EXPECT_EQ(stats.uptime_seconds(), 5);
  ASSERT_GT(stats.samples_size(), 0);
  for (const v1::MetricSample& sample : stats.samples()) EXPECT_EQ(sample.labels().at("group"), "a") << sample.name();
  EXPECT_EQ(stats.counters().at("epfabric_region_bytes{group=\"a\",kind=\"nvl\"}"), 4096u);
}

TEST(DaemonMetrics, CountsRanksGoingDown) {
  DaemonMetrics metrics([] { return DaemonSnapshot(); });
  v1::Membership view;
  for (int r = 0; r < 3; ++r) view.add_members()->set_rank(r);
  for (auto& m : *view.mutable_members()) m.set_state(v1::MEMBER_STATE_UP);
  metrics.OnMembership(view);
  view.mutable_members(2)->set_state(v1::MEMBER_STATE_DOWN);
  metrics.OnMembership(view);
  metrics.OnMembership(view);  // still down: counted once
  EXPECT_THAT(metrics.Render(), HasSubstr("epfabric_member_down_events_total{rank=\"2\"} 1\n"));
}

}  // namespace
}  // namespace epfabric::daemon::metrics

namespace epfabric::daemon {
namespace {

TEST(Logging, JsonFormatterEscapesAndNamesTheLogger) {
  std::ostringstream stream;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(stream);
  spdlog::logger logger("fabric", sink);
  logger.set_formatter(MakeJsonFormatter());
  logger.warn("rank {} said \"no\"\n\tbye", 3);
  const std::string line = stream.str();
  EXPECT_THAT(line,
              ::testing::MatchesRegex(
                  R"(\{"time":"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]{8}\.[0-9]{3}Z","level":"warning","logger":"fabric",)"
                  R"("message":"rank 3 said \\"no\\"\\n\\tbye","pid":[0-9]+,"thread":[0-9]+\}
)"));
}

}  // namespace
}  // namespace epfabric::daemon
