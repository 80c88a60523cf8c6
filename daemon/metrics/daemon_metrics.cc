#include "daemon/metrics/daemon_metrics.h"

#include "absl/strings/str_cat.h"

namespace dos {
namespace {

// The host memory held as state (--host_memory_limit), and of it what closed
// sessions' views hold.
void RegisterHostStateGauges(MetricsRegistry* m, const HostMemoryBudget* budget) {
  m->AddCallbackGauge("dos_host_state_bytes",
                      "Host memory held as optimizer state and delayed-update buffers, "
                      "counted against --host_memory_limit (page-locked in GPU mode).",
                      {}, [budget] { return static_cast<double>(budget->used()); })
      .IgnoreError();
  m->AddCallbackGauge("dos_host_state_viewed_bytes",
                      "Of dos_host_state_bytes: the state of closed sessions a trainer still "
                      "maps (state_dict()'s views), charged until it drops them.",
                      {}, [budget] { return static_cast<double>(budget->viewed().bytes); })
      .IgnoreError();
  m->AddCallbackGauge("dos_host_state_limit_bytes", "--host_memory_limit (0: none).", {}, [budget] {
     return static_cast<double>(budget->limit());
   }).IgnoreError();
}

}  // namespace

void RegisterMetrics(MetricsRegistry* m, const DaemonCounters* c, SessionManager* sessions,
                     const HostMemoryBudget* budget) {
  auto counter = [m](const char* name, const char* help, const std::atomic<uint64_t>* v,
                     MetricLabels labels = {}) {
    m->AddCallbackCounter(name, help, labels, [v] { return v->load(std::memory_order_relaxed); })
        .IgnoreError();
  };
  counter("dos_steps_total", "Optimizer steps answered (skipped ones included).", &c->steps);
  counter("dos_skipped_steps_total", "Steps skipped for non-finite gradients.",
          &c->skipped_steps);
  counter("dos_step_errors_total", "Steps answered with an error.", &c->failed_steps);
  counter("dos_params_updated_total", "Parameters updated, by device.", &c->cpu_params,
          {{"device", "cpu"}});
  counter("dos_params_updated_total", "Parameters updated, by device.", &c->gpu_params,
          {{"device", "gpu"}});
  counter("dos_pcie_bytes_total", "Bytes copied over PCIe, by direction.", &c->h2d_bytes,
          {{"direction", "h2d"}});
  counter("dos_pcie_bytes_total", "Bytes copied over PCIe, by direction.", &c->d2h_bytes,
          {{"direction", "d2h"}});
  counter("dos_update_microseconds_total", "Time spent updating (params/s = rate of "
          "dos_params_updated_total over rate of this).", &c->update_us);
  constexpr const char* kStallHelp =
      "Time steps lost to checkpoints: waiting for the session lock (snapshot start, state "
      "transfer) or copying subgroups for an in-flight snapshot (copy-on-write).";
  counter("dos_checkpoint_stall_microseconds_total", kStallHelp, &c->lock_wait_us,
          {{"cause", "lock"}});
  counter("dos_checkpoint_stall_microseconds_total", kStallHelp, &c->snapshot_wait_us,
          {{"cause", "copy_on_write"}});
  m->AddCallbackGauge("dos_sessions", "Sessions attached.", {},
                      [sessions] { return static_cast<double>(sessions->List().size()); })
      .IgnoreError();
  m->AddCallbackGauge("dos_orphaned_sessions", "Sessions of dead trainers kept for a resume.",
                      {}, [sessions] {
                        return static_cast<double>(sessions->ListOrphans().size());
                      })
      .IgnoreError();
  RegisterHostStateGauges(m, budget);
  m->AddCallbackGauge("dos_params_per_second", "Sum over sessions of the last step's rate.", {},
                      [sessions] {
                        double sum = 0;
                        for (const auto& s : sessions->List()) {
                          SessionStatsSnapshot st = s->stats();
                          if (st.last.update_us > 0 && !st.last.found_inf) {
                            sum += static_cast<double>(s->summary().params) /
                                   (st.last.update_us * 1e-6);
                          }
                        }
                        return sum;
                      })
      .IgnoreError();
  // Per uid, what it holds of each bounded resource (docs/threat-model.md),
  // and the per-uid bounds.
  m->AddCallbackGaugeFamily(
       "dos_uid_usage", "What each uid holds of dosd's bounded resources (by resource).",
       [sessions] {
         MetricsRegistry::SeriesList out;
         for (const auto& [uid, u] : sessions->UsageByUid()) {
           const std::string id = absl::StrCat(uid);
           out.push_back(
               {{{"uid", id}, {"resource", "sessions"}}, static_cast<double>(u.sessions)});
           for (int r = 0; r < kNumUidResources; ++r) {
             out.push_back({{{"uid", id}, {"resource", UidResourceName(UidResource(r))}},
                            static_cast<double>(u.used[r])});
           }
         }
         return out;
       })
      .IgnoreError();
  const UidLimits limits = sessions->Limits();
  for (int r = 0; r < kNumUidResources; ++r) {
    m->AddCallbackGauge("dos_uid_limit", "The per-uid bound of each resource (0: none).",
                        {{"resource", UidResourceName(UidResource(r))}},
                        [v = limits.per_uid[r]] { return static_cast<double>(v); })
        .IgnoreError();
  }
  // One series per GPU engine, labelled with its device: the sessions it runs.
  for (const GpuDeviceInfo& d : sessions->executors()->devices()) {
    m->AddCallbackGauge("dos_gpu_engine_sessions",
                        "Registered sessions running on each GPU engine (by device).",
                        {{"device", absl::StrCat("cuda:", d.ordinal)}, {"uuid", d.uuid},
                         {"name", d.name}},
                        [sessions, ordinal = d.ordinal] {
                          double n = 0;
                          for (const auto& s : sessions->List()) {
                            n += s->summary().gpu_device == ordinal ? 1 : 0;
                          }
                          return n;
                        })
        .IgnoreError();
  }
}

std::function<void(uint32_t, const CheckpointUsage&)> CheckpointUsageGauges(MetricsRegistry* m,
                                                                            uint64_t quota) {
  if (absl::StatusOr<Gauge*> g = m->AddGauge(
          "dos_checkpoint_quota_bytes", "--checkpoint_quota: bytes per uid (0: none).");
      g.ok()) {
    (*g)->Set(static_cast<double>(quota));
  }
  return [m](uint32_t uid, const CheckpointUsage& u) {
    const MetricLabels labels = {{"uid", absl::StrCat(uid)}};
    if (absl::StatusOr<Gauge*> g = m->AddGauge(
            "dos_checkpoint_bytes", "Bytes in each uid's folder of the checkpoint store.",
            labels);
        g.ok()) {
      (*g)->Set(static_cast<double>(u.bytes));
    }
    if (absl::StatusOr<Gauge*> g = m->AddGauge(
            "dos_checkpoint_files", "Files in each uid's folder of the checkpoint store.",
            labels);
        g.ok()) {
      (*g)->Set(static_cast<double>(u.files));
    }
  };
}

}  // namespace dos
