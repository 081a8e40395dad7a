#include "base/metrics/metrics.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"

namespace offload {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string Scrape(const MetricsServer& server) {
  const std::string& address = server.address();
  const size_t colon = address.rfind(':');
  httplib::Client client(address.substr(0, colon), std::stoi(address.substr(colon + 1)));
  httplib::Result result = client.Get("/metrics");
  if (!result || result->status != 200) return "";
  return result->body;
}

TEST(MetricsServerTest, ServesRegistryProcessAndCallbackMetrics) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", "metrics_test");
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_THAT((*server)->address(), Not(HasSubstr(":0")));

  prometheus::Counter& counter = prometheus::BuildCounter()
                                     .Name("offload_test_events_total")
                                     .Help("Events of the test.")
                                     .Register(MetricsRegistry())
                                     .Add({});
  counter.Increment(3);
  int calls = 0;
  (*server)->Add(
      CallbackMetric::Gauge("offload_test_depth", "Depth read at scrape time.", [&calls] {
        ++calls;
        return std::vector<CallbackMetric::Sample>{{{{"queue", "a"}}, 7}};
      }));
  (*server)->Add(CallbackMetric::Counter("offload_test_done_total", "Done, kept elsewhere.", [] {
    return std::vector<CallbackMetric::Sample>{{{}, 5}};
  }));

  const std::string page = Scrape(**server);
  EXPECT_THAT(page, HasSubstr("offload_test_events_total 3"));
  EXPECT_THAT(page, HasSubstr("offload_test_depth{queue=\"a\"} 7"));
  EXPECT_THAT(page, HasSubstr("# TYPE offload_test_done_total counter"));
  EXPECT_THAT(page, HasSubstr("offload_test_done_total 5"));
  EXPECT_THAT(page, HasSubstr("offload_build_info{binary=\"metrics_test\""));
  EXPECT_THAT(page, HasSubstr("# TYPE process_cpu_seconds_total counter"));
  EXPECT_THAT(page, HasSubstr("process_resident_memory_bytes "));
  EXPECT_THAT(page, HasSubstr("process_start_time_seconds "));
  EXPECT_THAT(page, HasSubstr("process_open_fds "));
  EXPECT_EQ(calls, 1);
  // Read again at the next scrape, not cached.
  Scrape(**server);
  EXPECT_EQ(calls, 2);
}

TEST(MetricsServerTest, ProcessMetricsAreSane) {
  std::vector<prometheus::MetricFamily> families = MakeProcessCollector()->Collect();
  std::map<std::string, double> values;
  for (const auto& f : families) {
    values[f.name] = f.type == prometheus::MetricType::Counter ? f.metric.at(0).counter.value
                                                               : f.metric.at(0).gauge.value;
  }
  EXPECT_GT(values["process_resident_memory_bytes"], 1 << 20);
  EXPECT_GE(values["process_virtual_memory_bytes"], values["process_resident_memory_bytes"]);
  EXPECT_GT(values["process_open_fds"], 2);
  // Started within the last day, not in 1970.
  EXPECT_GT(values["process_start_time_seconds"], static_cast<double>(time(nullptr)) - 86400);
  EXPECT_LE(values["process_start_time_seconds"], static_cast<double>(time(nullptr)) + 1);
}

TEST(MetricsServerTest, BadAddressesAreErrors) {
  EXPECT_EQ(MetricsServer::Start("no-port", "t").status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<MetricsServer>> first = MetricsServer::Start("127.0.0.1:0", "t");
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start((*first)->address(), "t");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr((*first)->address()));
}

TEST(MetricsServerTest, EmptyAddressServesNothing) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> none = StartMetricsServerIfAsked("", "t");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);
}

TEST(DurationBucketsTest, CoverMillisecondsToMinutes) {
  const std::vector<double>& b = DurationBuckets();
  EXPECT_DOUBLE_EQ(b.front(), 0.001);
  EXPECT_GT(b.back(), 60);
}

}  // namespace
}  // namespace offload
