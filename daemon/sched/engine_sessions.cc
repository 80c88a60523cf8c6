#include "daemon/sched/engine_sessions.h"

#include <algorithm>

#include "daemon/state/shard_state.h"

namespace dos {

uint64_t EngineSessions::StagingBytes(const ShardLayout& layout) const {
  const uint64_t max_numel = layout.max_subgroup_numel();
  // The engine's slots hold fp32 state whatever the shard's format.
  const uint64_t per_param =
      ShardState::kStateBytesPerParam + (budgets_.staging_io ? kStagedIoBytesPerParam : 0);
  uint64_t bytes = uint64_t{budgets_.staging_slots} * max_numel * per_param;
  if (grad_fp32_) bytes += 2 * max_numel * sizeof(float);
  return bytes;
}

void EngineSessions::SetLease(uint64_t session, const GpuLease& lease, const ShardLayout& layout) {
  const uint64_t staging = StagingBytes(layout);
  // The most a session can keep resident: every subgroup charged the largest
  // one's state, as StepPlanner::ResidentCount charges them. A lease beyond
  // it asks for no more, so that under a budget it does not shrink the
  // other sessions' shares for memory it could never use.
  const unsigned __int128 whole_state =
      static_cast<unsigned __int128>(layout.max_subgroup_state_bytes()) *
      layout.subgroup_numel.size();
  absl::MutexLock lock(&mu_);
  Share& share = shares_[session];
  if (lease.reported) {
    share.lease = lease;
  } else if (!share.lease.reported) {
    share.lease = GpuLease{};
  }  // else: a step without the flag keeps the session's last lease
  share.asks = !share.lease.reported               ? budgets_.gpu_resident_bytes
               : share.lease.lease_bytes > staging ? share.lease.lease_bytes - staging
                                                   : 0;
  if (share.lease.reported && share.asks > whole_state) {
    share.asks = static_cast<uint64_t>(whole_state);
  }
}

void EngineSessions::Bind(uint64_t session) {
  absl::MutexLock lock(&mu_);
  bound_.insert(session);
}

void EngineSessions::Unbind(uint64_t session) {
  absl::MutexLock lock(&mu_);
  bound_.erase(session);
  if (auto it = shares_.find(session); it != shares_.end()) it->second.steps = false;
}

void EngineSessions::Forget(uint64_t session) {
  absl::MutexLock lock(&mu_);
  shares_.erase(session);
  bound_.erase(session);
}

bool EngineSessions::Shared(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  return bound_.size() > (bound_.contains(session) ? 1u : 0u);
}

bool EngineSessions::Alone() const {
  absl::MutexLock lock(&mu_);
  return bound_.size() <= 1 && std::count_if(shares_.begin(), shares_.end(),
                                             [](const auto& s) { return s.second.steps; }) <= 1;
}

GpuLease EngineSessions::LeaseOf(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  auto it = shares_.find(session);
  return it == shares_.end() ? GpuLease{} : it->second.lease;
}

uint64_t EngineSessions::ResidentBytes(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  auto it = shares_.find(session);
  if (it == shares_.end()) return 0;
  const uint64_t cap = budgets_.gpu_resident_bytes;
  const uint64_t asks = it->second.asks;
  if (cap == 0) return asks;
  unsigned __int128 total = 0;
  for (const auto& [id, share] : shares_) total += share.asks;
  if (total <= cap) return asks;
  return static_cast<uint64_t>(static_cast<unsigned __int128>(asks) * cap / total);
}

}  // namespace dos
