// RegisterMetrics: the daemon's Prometheus series (README, "Observability"):
// daemon-lifetime counters from DaemonCounters, and gauges read at scrape
// time from the SessionManager and the HostMemoryBudget.
//
// Ownership: every pointer must outlive `m`'s renders. Thread-safety: call
// once, before the metrics endpoint serves.
#pragma once

#include "daemon/metrics/metrics_registry.h"
#include "daemon/session/daemon_counters.h"
#include "daemon/session/session_manager.h"
#include "daemon/state/host_memory_budget.h"

namespace dos {

void RegisterMetrics(MetricsRegistry* m, const DaemonCounters* c, SessionManager* sessions,
                     const HostMemoryBudget* budget);

}  // namespace dos
