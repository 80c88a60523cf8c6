// MetricsRegistry: the daemon's counters and gauges, rendered in the
// Prometheus text exposition format 0.0.4 for the /metrics endpoint
// (MetricsHttpServer).
//
// A metric is a family (name, help, type) with one series per label set.
// Components register their series once, keep the returned pointer and
// update it on their own threads: Counter::Add and Gauge::Set/Add are single
// relaxed atomic operations (no lock, no allocation), cheap enough for every
// step. Values that already live elsewhere (sessions attached, pinned bytes)
// are registered as callbacks and read only when scraped.
//
//   MetricsRegistry metrics;
//   Counter* steps = *metrics.AddCounter("dos_steps_total", "Optimizer steps applied.");
//   steps->Add();
//   metrics.AddCallbackGauge("dos_sessions", "Attached sessions.", {},
//                            [&] { return double(sessions.List().size()); });
//   std::string page = metrics.RenderText();
//
// Ownership: the registry owns every series; pointers stay valid until the
// series is removed (RemoveSeries) or the registry is destroyed.
// Thread-safety: all methods are thread-safe. Registration, removal and
// rendering take one mutex; updates take none. Callbacks run on the rendering
// thread with the registry's mutex held, so they must not call back into the
// registry.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace dos {

// Label names and values of one series, e.g. {{"session", "3"}, {"device", "cpu"}}.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

// A monotonically increasing count (Prometheus `counter`).
class Counter {
 public:
  void Add(uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down (Prometheus `gauge`).
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double d) { value_.fetch_add(d, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class MetricsRegistry {
 public:
  // Content-Type of RenderText()'s output.
  static constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

  // Registers (or finds, when the same name and labels were registered with
  // the same type) a series. INVALID_ARGUMENT for a name or label name that
  // Prometheus does not accept, ALREADY_EXISTS when the name is taken by a
  // family of another type or help text.
  absl::StatusOr<Counter*> AddCounter(absl::string_view name, absl::string_view help,
                                      const MetricLabels& labels = {});
  absl::StatusOr<Gauge*> AddGauge(absl::string_view name, absl::string_view help,
                                  const MetricLabels& labels = {});
  // A gauge read from `read` at each scrape; ALREADY_EXISTS if that series
  // exists.
  absl::Status AddCallbackGauge(absl::string_view name, absl::string_view help,
                                const MetricLabels& labels, std::function<double()> read);
  // A counter read from `read` at each scrape (for counts kept elsewhere).
  absl::Status AddCallbackCounter(absl::string_view name, absl::string_view help,
                                  const MetricLabels& labels, std::function<uint64_t()> read);

  // A gauge family whose series are read at each scrape, all at once, from
  // `read` (labels -> value): series that come and go (one per uid).
  // ALREADY_EXISTS if the name is taken.
  using SeriesList = std::vector<std::pair<MetricLabels, double>>;
  absl::Status AddCallbackGaugeFamily(absl::string_view name, absl::string_view help,
                                      std::function<SeriesList()> read);

  // Removes one series (e.g. a detached session's); its pointer dangles
  // afterwards. NOT_FOUND if absent.
  absl::Status RemoveSeries(absl::string_view name, const MetricLabels& labels);

  // Every family, sorted by name, in the text format 0.0.4.
  std::string RenderText() const;

 private:
  enum class Type { kCounter, kGauge };
  struct Series {
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::function<double()> read_gauge;
    std::function<uint64_t()> read_counter;
  };
  struct Family {
    Type type;
    std::string help;
    std::map<MetricLabels, Series> series;
    std::function<SeriesList()> read_family;  // AddCallbackGaugeFamily
  };

  // The family `name`, created if absent; checks name, type and help.
  absl::StatusOr<Family*> FamilyFor(absl::string_view name, absl::string_view help, Type type,
                                    const MetricLabels& labels)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Family, std::less<>> families_ ABSL_GUARDED_BY(mu_);
};

// True for names matching [a-zA-Z_:][a-zA-Z0-9_:]* (labels: no ':', no "__" prefix).
bool IsValidMetricName(absl::string_view name);
bool IsValidLabelName(absl::string_view name);
// Text-format escaping: HELP escapes '\' and newline; label values also '"'.
std::string EscapeHelp(absl::string_view help);
std::string EscapeLabelValue(absl::string_view value);
// A sample value as the text format writes it (NaN, +Inf, -Inf, shortest
// round-trip decimal otherwise).
std::string FormatSampleValue(double v);

}  // namespace dos
