#include "daemon/rpc/uid_usage.h"

namespace dos {
namespace {

void Fill(uint32_t sessions, const UidAmounts& a, v1::UidUsage* u) {
  auto at = [&a](UidResource r) { return a[static_cast<size_t>(r)]; };
  u->set_sessions(sessions);
  u->set_mapped_bytes(at(UidResource::kMappedBytes));
  u->set_connections(static_cast<uint32_t>(at(UidResource::kConnections)));
  u->set_early_steps(static_cast<uint32_t>(at(UidResource::kEarlySteps)));
  u->set_bookkeeping_bytes(at(UidResource::kBookkeepingBytes));
  u->set_tensors(at(UidResource::kTensors));
  u->set_segments(at(UidResource::kSegments));
  u->set_state_views(static_cast<uint32_t>(at(UidResource::kStateViews)));
  u->set_state_bytes(at(UidResource::kStateBytes));
  u->set_closed_control_blocks(static_cast<uint32_t>(at(UidResource::kClosedBlocks)));
}

}  // namespace

void FillUidUsage(const SessionManager& sessions, v1::GetStatsResponse* resp) {
  for (const auto& [uid, usage] : sessions.UsageByUid()) {
    v1::UidUsage* u = resp->add_uids();
    u->set_uid(uid);
    Fill(usage.sessions, usage.used, u);
  }
  const UidLimits limits = sessions.Limits();
  Fill(sessions.max_sessions_per_uid(), limits.per_uid, resp->mutable_uid_limits());
}

absl::Status AdmitRegistration(const Session& session, const v1::RegisterShardRequest& req) {
  uint64_t bytes = 0;
  for (int i = 0; i < req.tensors_size(); ++i) {
    const size_t name = req.tensors(i).name().size();
    if (absl::Status st = CheckTensorName(static_cast<uint32_t>(i), name); !st.ok()) return st;
    bytes += kBookkeepingBytesPerTensor + name;
  }
  return session.CheckBookkeeping(static_cast<uint64_t>(req.tensors_size()), bytes);
}

}  // namespace dos
