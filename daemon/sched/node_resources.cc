#include "daemon/sched/node_resources.h"

#include <algorithm>
#include <utility>

namespace dos {
namespace {
constexpr double kMinShare = 0.01;
}  // namespace

NodeResources::NodeResources(Options options) : options_(std::move(options)) {}

int NodeResources::AddEngine(std::string name, const PerfInputs& initial) {
  absl::MutexLock lock(&mu_);
  if (engines_.empty()) model_ = PerfModel(initial);
  Engine e;
  e.name = name;
  e.host_alone = initial.host_bytes_per_s;
  e.view.host_alone_bytes_per_s = e.host_alone;
  e.view.name = std::move(name);
  engines_.push_back(std::move(e));
  return static_cast<int>(engines_.size()) - 1;
}

int NodeResources::engines() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(engines_.size());
}

bool NodeResources::ActiveLocked(const Engine& e, absl::Time now) const {
  if (e.stepping > 0) return true;
  if (!e.stepped) return false;
  const absl::Duration window = std::max(
      options_.min_window, std::min(options_.max_window, options_.window_periods * e.period));
  return now - e.last_end <= window;
}

double NodeResources::ShareLocked(int id, absl::Time now) const {
  // The engine asking counts as active; the others by the rule above.
  double total = 0;
  int active = 0;
  for (size_t i = 0; i < engines_.size(); ++i) {
    if (static_cast<int>(i) != id && !ActiveLocked(engines_[i], now)) continue;
    total += static_cast<double>(engines_[i].host_params);
    ++active;
  }
  if (active <= 1) return 1.0;
  const double mine = static_cast<double>(engines_[id].host_params);
  // No demand known anywhere yet (or none at all): equal shares.
  if (total <= 0) return 1.0 / active;
  // An engine that asks with no host demand (everything resident, or a plan
  // made outside a step) still gets a sliver, so no model rate is zero.
  return std::max(mine / total, kMinShare);
}

double NodeResources::Begin(int id, uint64_t host_params) {
  const absl::Time now = Now();
  absl::MutexLock lock(&mu_);
  Engine& e = engines_[id];
  e.host_params = e.stepping > 0 ? e.host_params + host_params : host_params;
  ++e.stepping;
  if (e.last_start != absl::InfinitePast()) e.period = now - e.last_start;
  e.last_start = now;
  return ShareLocked(id, now);
}

double NodeResources::Share(int id) const {
  const absl::Time now = Now();
  absl::MutexLock lock(&mu_);
  return ShareLocked(id, now);
}

PerfInputs NodeResources::Apply(const PerfInputs& in, double share) const {
  PerfInputs out = in;
  absl::MutexLock lock(&mu_);
  out.cpu_params_per_s = model_.inputs().cpu_params_per_s * share;
  out.host_bytes_per_s = model_.inputs().host_bytes_per_s * share;
  out.host_shared_bytes_per_s = in.host_shared_bytes_per_s * share;
  return out;
}

PerfInputs NodeResources::Apply(int id, const PerfInputs& in, double share) const {
  PerfInputs out = in;
  absl::MutexLock lock(&mu_);
  out.cpu_params_per_s = model_.inputs().cpu_params_per_s * share;
  out.host_bytes_per_s =
      std::min(engines_[id].host_alone, model_.inputs().host_bytes_per_s * share);
  out.host_shared_bytes_per_s = in.host_shared_bytes_per_s * share;
  return out;
}

void NodeResources::Planned(int id, uint64_t params, double share, double predicted_us,
                            const std::string& binding) {
  absl::MutexLock lock(&mu_);
  EngineView& v = engines_[id].view;
  v.params = params;
  v.host_params = engines_[id].host_params;
  v.planned_share = share;
  v.predicted_us = predicted_us;
  v.binding = binding;
}

void NodeResources::End(int id, const StepEnd& end, uint64_t host_params) {
  const absl::Time now = Now();
  absl::MutexLock lock(&mu_);
  Engine& e = engines_[id];
  if (e.stepping == 0) return;
  if (--e.stepping > 0) e.host_params -= std::min(e.host_params, host_params);
  e.stepped = true;
  e.last_end = now;
  if (end.measured_us <= 0) {  // failed: nothing measured, no traffic record
    e.last_host_rate = 0;
    return;
  }
  e.view.measured_us = end.measured_us;
  const double share = std::clamp(end.share, 1e-3, 1.0);
  if (end.cpu_params > 0 && end.cpu_busy_s > 0) {
    model_.set_transfer_sizes(end.grad_bytes, end.weight_bytes, end.state_bytes);
    model_.ObserveCpu(end.cpu_params / share, end.cpu_busy_s);
  }
  // The update's window ends now; its traffic flowed over its update time
  // less the model's other terms (a step that was nearly all fill and drain
  // says nothing about the host: not learned from).
  const double wall_s = end.measured_us * 1e-6;
  const double flow_s = wall_s - std::max(0.0, end.other_s);
  e.record_start = now - absl::Seconds(wall_s);
  e.record_end = now;
  e.last_host_rate = 0;
  if (end.host_bytes <= 0 || flow_s < 0.25 * wall_s) return;
  const double own = end.host_bytes / flow_s;
  e.last_host_rate = own;
  // The node's traffic over this step: its own rate plus every other
  // engine's last step's, weighted by the part of this step it overlapped.
  // An engine still stepping is counted when it ends (it counts this one).
  double rate = own;
  bool alone = share >= 1.0;
  for (size_t i = 0; i < engines_.size(); ++i) {
    const Engine& o = engines_[i];
    if (static_cast<int>(i) == id) continue;
    if (o.stepping > 0) alone = false;
    if (o.stepping > 0 || !o.stepped || o.last_host_rate <= 0) continue;
    const absl::Time a = std::max(e.record_start, o.record_start);
    const absl::Time b = std::min(now, o.record_end);
    if (b <= a) continue;
    alone = false;
    rate += o.last_host_rate * absl::ToDoubleSeconds(b - a) / wall_s;
  }
  model_.ObserveHostTraffic(rate, 1.0);
  if (alone) {
    e.host_alone = std::max(e.host_alone, own);
    e.view.host_alone_bytes_per_s = e.host_alone;
  }
}

NodeResources::View NodeResources::Snapshot() const {
  const absl::Time now = Now();
  absl::MutexLock lock(&mu_);
  View v;
  v.host_bytes_per_s = model_.inputs().host_bytes_per_s;
  v.cpu_params_per_s = model_.inputs().cpu_params_per_s;
  double params = 0, slowest_s = 0;
  bool all_predicted = true;
  for (size_t i = 0; i < engines_.size(); ++i) {
    EngineView ev = engines_[i].view;
    ev.active = ActiveLocked(engines_[i], now);
    ev.share = ev.active ? ShareLocked(static_cast<int>(i), now) : 0;
    if (ev.active) {
      ++v.active;
      params += static_cast<double>(ev.params);
      if (ev.predicted_us <= 0) all_predicted = false;
      slowest_s = std::max(slowest_s, ev.predicted_us * 1e-6);
    }
    v.engines.push_back(std::move(ev));
  }
  if (v.active > 0 && all_predicted && slowest_s > 0) v.bound_params_per_s = params / slowest_s;
  return v;
}

}  // namespace dos
