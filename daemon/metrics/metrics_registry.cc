#include "daemon/metrics/metrics_registry.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace dos {
namespace {

bool NameChar(char c, bool first, bool allow_colon) {
  if (absl::ascii_isalpha(c) || c == '_') return true;
  if (c == ':') return allow_colon;
  return !first && absl::ascii_isdigit(c);
}

}  // namespace

bool IsValidMetricName(absl::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!NameChar(name[i], i == 0, true)) return false;
  }
  return true;
}

bool IsValidLabelName(absl::string_view name) {
  if (name.empty() || (name.size() >= 2 && name[0] == '_' && name[1] == '_')) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!NameChar(name[i], i == 0, false)) return false;
  }
  return true;
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '"') out += "\\\"";
    else out += c;
  }
  return out;
}

std::string FormatSampleValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // Integral values (byte counts, sessions) print without an exponent.
  if (v == std::trunc(v) && std::fabs(v) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  // Prefer the shortest form that reads back to the same double.
  for (int prec = 6; prec < 17; ++prec) {
    char shorter[32];
    std::snprintf(shorter, sizeof shorter, "%.*g", prec, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

absl::StatusOr<MetricsRegistry::Family*> MetricsRegistry::FamilyFor(absl::string_view name,
                                                                    absl::string_view help,
                                                                    Type type,
                                                                    const MetricLabels& labels) {
  if (!IsValidMetricName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric name '", name, "' must match [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  for (const auto& [k, v] : labels) {
    if (!IsValidLabelName(k)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metric ", name, ": label name '", k, "' must match [a-zA-Z_][a-zA-Z0-9_]* "
          "and not start with __"));
    }
  }
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(std::string(name), Family{type, std::string(help), {}, {}}).first;
  } else if (it->second.type != type || it->second.help != help) {
    return absl::AlreadyExistsError(absl::StrCat(
        "metric ", name, " is already registered with another type or help text"));
  }
  return &it->second;
}

absl::StatusOr<Counter*> MetricsRegistry::AddCounter(absl::string_view name,
                                                     absl::string_view help,
                                                     const MetricLabels& labels) {
  absl::MutexLock l(&mu_);
  absl::StatusOr<Family*> f = FamilyFor(name, help, Type::kCounter, labels);
  if (!f.ok()) return f.status();
  Series& s = (*f)->series[labels];
  if (s.read_counter) {
    return absl::AlreadyExistsError(absl::StrCat("metric ", name, " series is a callback"));
  }
  if (s.counter == nullptr) s.counter = std::make_unique<Counter>();
  return s.counter.get();
}

absl::StatusOr<Gauge*> MetricsRegistry::AddGauge(absl::string_view name, absl::string_view help,
                                                 const MetricLabels& labels) {
  absl::MutexLock l(&mu_);
  absl::StatusOr<Family*> f = FamilyFor(name, help, Type::kGauge, labels);
  if (!f.ok()) return f.status();
  Series& s = (*f)->series[labels];
  if (s.read_gauge) {
    return absl::AlreadyExistsError(absl::StrCat("metric ", name, " series is a callback"));
  }
  if (s.gauge == nullptr) s.gauge = std::make_unique<Gauge>();
  return s.gauge.get();
}

absl::Status MetricsRegistry::AddCallbackGauge(absl::string_view name, absl::string_view help,
                                               const MetricLabels& labels,
                                               std::function<double()> read) {
  absl::MutexLock l(&mu_);
  absl::StatusOr<Family*> f = FamilyFor(name, help, Type::kGauge, labels);
  if (!f.ok()) return f.status();
  auto [it, inserted] = (*f)->series.try_emplace(labels);
  if (!inserted) return absl::AlreadyExistsError(absl::StrCat("metric ", name, " series exists"));
  it->second.read_gauge = std::move(read);
  return absl::OkStatus();
}

absl::Status MetricsRegistry::AddCallbackCounter(absl::string_view name, absl::string_view help,
                                                 const MetricLabels& labels,
                                                 std::function<uint64_t()> read) {
  absl::MutexLock l(&mu_);
  absl::StatusOr<Family*> f = FamilyFor(name, help, Type::kCounter, labels);
  if (!f.ok()) return f.status();
  auto [it, inserted] = (*f)->series.try_emplace(labels);
  if (!inserted) return absl::AlreadyExistsError(absl::StrCat("metric ", name, " series exists"));
  it->second.read_counter = std::move(read);
  return absl::OkStatus();
}

absl::Status MetricsRegistry::RemoveSeries(absl::string_view name, const MetricLabels& labels) {
  absl::MutexLock l(&mu_);
  auto it = families_.find(name);
  if (it == families_.end() || it->second.series.erase(labels) == 0) {
    return absl::NotFoundError(absl::StrCat("metric ", name, " has no such series"));
  }
  if (it->second.series.empty()) families_.erase(it);
  return absl::OkStatus();
}

absl::Status MetricsRegistry::AddCallbackGaugeFamily(absl::string_view name,
                                                    absl::string_view help,
                                                    std::function<SeriesList()> read) {
  absl::MutexLock l(&mu_);
  if (families_.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("metric family ", name, " already exists"));
  }
  absl::StatusOr<Family*> f = FamilyFor(name, help, Type::kGauge, {});
  if (!f.ok()) return f.status();
  (*f)->read_family = std::move(read);
  return absl::OkStatus();
}

std::string MetricsRegistry::RenderText() const {
  absl::MutexLock l(&mu_);
  std::string out;
  for (const auto& [name, family] : families_) {
    absl::StrAppend(&out, "# HELP ", name, " ", EscapeHelp(family.help), "\n# TYPE ", name,
                    family.type == Type::kCounter ? " counter\n" : " gauge\n");
    auto series_name = [&](const MetricLabels& labels) {
      out += name;
      if (!labels.empty()) {
        out += '{';
        for (size_t i = 0; i < labels.size(); ++i) {
          absl::StrAppend(&out, i ? "," : "", labels[i].first, "=\"",
                          EscapeLabelValue(labels[i].second), "\"");
        }
        out += '}';
      }
      out += ' ';
    };
    if (family.read_family) {
      for (const auto& [labels, v] : family.read_family()) {
        series_name(labels);
        absl::StrAppend(&out, FormatSampleValue(v), "\n");
      }
    }
    for (const auto& [labels, s] : family.series) {
      series_name(labels);
      if (s.counter) out += absl::StrCat(s.counter->value());
      else if (s.read_counter) out += absl::StrCat(s.read_counter());
      else if (s.gauge) out += FormatSampleValue(s.gauge->value());
      else if (s.read_gauge) out += FormatSampleValue(s.read_gauge());
      out += '\n';
    }
  }
  return out;
}

}  // namespace dos
