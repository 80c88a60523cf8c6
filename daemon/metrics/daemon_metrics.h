// RegisterMetrics: the daemon's Prometheus series (README, "Observability"):
// daemon-lifetime counters from DaemonCounters, and gauges read at scrape
// time from the SessionManager and the HostMemoryBudget.
//
// Ownership: every pointer must outlive `m`'s renders. Thread-safety: call
// once, before the metrics endpoint serves.
#pragma once

#include "daemon/metrics/metrics_registry.h"
#include "daemon/session/daemon_counters.h"
#include <functional>

#include "daemon/session/session_manager.h"
#include "daemon/session/user_folders.h"
#include "daemon/state/host_memory_budget.h"

namespace dos {

void RegisterMetrics(MetricsRegistry* m, const DaemonCounters* c, SessionManager* sessions,
                     const HostMemoryBudget* budget);

// dos_checkpoint_quota_bytes (registered now) and the setter of
// dos_checkpoint_bytes{uid} / dos_checkpoint_files{uid}, one series per uid
// measured (UserFoldersOptions::on_usage). `m` outlives the setter.
std::function<void(uint32_t, const CheckpointUsage&)> CheckpointUsageGauges(MetricsRegistry* m,
                                                                            uint64_t quota);

}  // namespace dos
