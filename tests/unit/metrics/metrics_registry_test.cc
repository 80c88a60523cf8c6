#include "daemon/metrics/metrics_registry.h"

#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

using ::testing::HasSubstr;

TEST(MetricsRegistryTest, RendersTheTextFormat) {
  MetricsRegistry m;
  Counter* steps = *m.AddCounter("dos_steps_total", "Optimizer steps applied.",
                                 {{"session", "3"}});
  Gauge* pinned = *m.AddGauge("dos_pinned_bytes", "Pinned host memory.\nIn bytes.");
  steps->Add(41);
  steps->Add();
  pinned->Set(1073741824);
  ASSERT_TRUE(m.AddCallbackGauge("dos_sessions", "Attached sessions.", {}, [] { return 2.0; })
                  .ok());
  ASSERT_TRUE(m.AddCallbackCounter("dos_errors_total", "Errors.", {{"kind", "rpc"}},
                                   [] { return uint64_t{7}; })
                  .ok());
  EXPECT_EQ(m.RenderText(),
            "# HELP dos_errors_total Errors.\n"
            "# TYPE dos_errors_total counter\n"
            "dos_errors_total{kind=\"rpc\"} 7\n"
            "# HELP dos_pinned_bytes Pinned host memory.\\nIn bytes.\n"
            "# TYPE dos_pinned_bytes gauge\n"
            "dos_pinned_bytes 1073741824\n"
            "# HELP dos_sessions Attached sessions.\n"
            "# TYPE dos_sessions gauge\n"
            "dos_sessions 2\n"
            "# HELP dos_steps_total Optimizer steps applied.\n"
            "# TYPE dos_steps_total counter\n"
            "dos_steps_total{session=\"3\"} 42\n");
}

TEST(MetricsRegistryTest, SeriesOfOneFamilyShareHeaderLines) {
  MetricsRegistry m;
  (*m.AddCounter("dos_params_total", "Params updated.", {{"device", "cpu"}}))->Add(5);
  (*m.AddCounter("dos_params_total", "Params updated.", {{"device", "gpu"}}))->Add(9);
  std::string text = m.RenderText();
  EXPECT_THAT(text, HasSubstr("dos_params_total{device=\"cpu\"} 5\n"
                              "dos_params_total{device=\"gpu\"} 9\n"));
  EXPECT_EQ(text.find("# TYPE"), text.rfind("# TYPE"));
}

TEST(MetricsRegistryTest, SameSeriesTwiceIsTheSameObject) {
  MetricsRegistry m;
  Counter* a = *m.AddCounter("c_total", "h", {{"a", "1"}});
  Counter* b = *m.AddCounter("c_total", "h", {{"a", "1"}});
  EXPECT_EQ(a, b);
}

TEST(MetricsRegistryTest, RejectsBadNamesAndConflicts) {
  MetricsRegistry m;
  EXPECT_EQ(m.AddCounter("1bad", "h").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.AddCounter("bad-name", "h").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.AddCounter("ok", "h", {{"__reserved", "x"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.AddCounter("ok", "h", {{"a:b", "x"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(m.AddCounter("x", "h").ok());
  EXPECT_EQ(m.AddGauge("x", "h").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(m.AddCounter("x", "other help").status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(m.AddCallbackGauge("g", "h", {}, [] { return 1.0; }).ok());
  EXPECT_EQ(m.AddCallbackGauge("g", "h", {}, [] { return 1.0; }).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(m.AddGauge("g", "h").status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(MetricsRegistryTest, EscapesLabelValues) {
  MetricsRegistry m;
  (*m.AddGauge("g", "h", {{"name", "a\"b\\c\nd"}}))->Set(1);
  EXPECT_THAT(m.RenderText(), HasSubstr("g{name=\"a\\\"b\\\\c\\nd\"} 1\n"));
}

TEST(MetricsRegistryTest, FormatsSpecialValues) {
  EXPECT_EQ(FormatSampleValue(std::numeric_limits<double>::quiet_NaN()), "NaN");
  EXPECT_EQ(FormatSampleValue(INFINITY), "+Inf");
  EXPECT_EQ(FormatSampleValue(-INFINITY), "-Inf");
  EXPECT_EQ(FormatSampleValue(0.25), "0.25");
  EXPECT_EQ(FormatSampleValue(-3), "-3");
  EXPECT_EQ(FormatSampleValue(1e20), "1e+20");
  EXPECT_EQ(std::strtod(FormatSampleValue(0.1 + 0.2).c_str(), nullptr), 0.1 + 0.2);
}

TEST(MetricsRegistryTest, RemoveSeries) {
  MetricsRegistry m;
  ASSERT_TRUE(m.AddGauge("g", "h", {{"session", "1"}}).ok());
  ASSERT_TRUE(m.AddGauge("g", "h", {{"session", "2"}}).ok());
  ASSERT_TRUE(m.RemoveSeries("g", {{"session", "1"}}).ok());
  EXPECT_THAT(m.RenderText(), ::testing::Not(HasSubstr("session=\"1\"")));
  EXPECT_EQ(m.RemoveSeries("g", {{"session", "1"}}).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(m.RemoveSeries("g", {{"session", "2"}}).ok());
  EXPECT_EQ(m.RenderText(), "");
}

TEST(MetricsRegistryTest, ConcurrentUpdatesAndScrapesLoseNothing) {
  MetricsRegistry m;
  Counter* c = *m.AddCounter("c_total", "h");
  Gauge* g = *m.AddGauge("g", "h");
  constexpr int kThreads = 4, kPer = 100000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kPer; ++i) {
        c->Add();
        g->Add(1.0);
      }
    });
  }
  std::thread scraper([&] {
    for (int i = 0; i < 200; ++i) EXPECT_THAT(m.RenderText(), HasSubstr("c_total "));
  });
  for (auto& t : threads) t.join();
  scraper.join();
  EXPECT_EQ(c->value(), uint64_t{kThreads} * kPer);
  EXPECT_EQ(g->value(), double{kThreads} * kPer);
}

}  // namespace
}  // namespace dos
