// The step timeline: one JSON line per GPU-mode step (which subgroup ran on
// which path, when), appended to --gpu_timeline for plots
// (bench/update/report.py reads it).
//
// Thread-safety: pure functions; AppendTimeline appends one whole line with
// one write, the caller serialises steps of one file.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "daemon/sched/policy.h"
#include "daemon/sched/step_plan.h"

namespace dos {

// {"step":N,"policy":"...","wall_us":...,"predicted_us":...,"entries":[...]}\n
std::string TimelineLine(int64_t step, const Policy& policy, double wall_us, double predicted_us,
                         std::span<const TimelineEntry> entries);
// Appends `line` to `path` (best effort: a timeline is a diagnostic).
void AppendTimeline(const std::string& path, const std::string& line);

}  // namespace dos
