#include "daemon/sched/step_timeline.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dos {

std::string TimelineLine(int64_t step, const Policy& policy, double wall_us, double predicted_us,
                         std::span<const TimelineEntry> entries) {
  std::string line = absl::StrFormat(
      "{\"step\":%d,\"policy\":\"%s\",\"wall_us\":%.1f,\"predicted_us\":%.1f,\"entries\":[", step,
      FormatPolicy(policy), wall_us, predicted_us);
  bool first = true;
  for (const TimelineEntry& e : entries) {
    absl::StrAppend(&line, first ? "" : ",",
                    absl::StrFormat("{\"sg\":%d,\"path\":\"%c\",\"in\":[%.1f,%.1f],"
                                    "\"kernel\":[%.1f,%.1f],\"out\":[%.1f,%.1f]}",
                                    e.subgroup, e.path, e.in0, e.in1, e.k0, e.k1, e.out0, e.out1));
    first = false;
  }
  absl::StrAppend(&line, "]}\n");
  return line;
}

void AppendTimeline(const std::string& path, const std::string& line) {
  if (FILE* f = std::fopen(path.c_str(), "a")) {
    std::fwrite(line.data(), 1, line.size(), f);
    std::fclose(f);
  }
}

}  // namespace dos
