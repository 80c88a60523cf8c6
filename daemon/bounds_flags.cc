#include "daemon/bounds_flags.h"

#include <unistd.h>

#include <algorithm>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/state/host_memory_budget.h"

ABSL_FLAG(int, max_sessions, 1024, "Sessions held at once (attached or orphaned); 0 = no cap.");
ABSL_FLAG(int, max_sessions_per_uid, 256, "Sessions one uid holds at once; 0 = no cap.");
ABSL_FLAG(absl::Duration, early_step_ready_timeout, absl::ZeroDuration(),
          "Longest an early step without a verdict (overlap=\"update\") waits for one "
          "subgroup's gradients, and an early step with one (overlap=True) for its verdict, "
          "from the step's begin; the GPU engine (or the session) is held meanwhile, so a "
          "trainer stalled mid-backward would hold up the other trainers on that GPU. The "
          "step then fails with DEADLINE_EXCEEDED. 0 = --session_lease (60s if that is 0).");
ABSL_FLAG(int, max_early_steps_per_uid, 16,
          "Early steps one uid may have waiting for their trainers at once; more fail with "
          "RESOURCE_EXHAUSTED. 0 = no cap.");
ABSL_FLAG(std::string, max_mapped_bytes_per_uid, "auto",
          "Bytes of trainer memory (buffers sent over the descriptor socket) dosd maps for one "
          "uid; a segment past it is refused before it is mapped. auto = the larger of the "
          "host's memory and --host_memory_limit; 0 = no cap.");
ABSL_FLAG(std::string, max_mapped_bytes_per_session, "auto",
          "The same per session; auto = --max_mapped_bytes_per_uid's value; 0 = no cap.");
ABSL_FLAG(int, max_segments_per_uid, 4096,
          "Trainer memory segments (memfds sent over the descriptor socket) dosd maps for one "
          "uid at once; each is one mapping, and vm.max_map_count (65530 by default) bounds "
          "dosd's mappings in all, so keep this x the trainer users well below it. 0 = no cap.");
ABSL_FLAG(int, max_state_views_per_uid, 512,
          "Shards whose state memory one uid was handed (state_dict()'s zero-copy views), its "
          "live sessions' and closed ones' it still maps; a closed one stays charged (one "
          "descriptor of dosd's, and its bytes to --host_memory_limit) until the trainer drops "
          "its views or exits. Past it state_dict() is refused. 0 = no cap.");
ABSL_FLAG(std::string, max_state_bytes_per_uid, "0",
          "Host memory one uid's optimizer state may take in all (its sessions' shards, live, "
          "waiting for a resume, or closed and still viewed); a registration past it is "
          "refused. On a node shared by several users set it, e.g. to --host_memory_limit "
          "divided by the users, so that no user's jobs can take the whole of it. 0 = no cap "
          "(--host_memory_limit and --session_memory_limit only).");
ABSL_FLAG(int, max_fd_connections_per_uid, 16,
          "Descriptor-socket connections of one uid waiting for dosd to serve them; more are "
          "refused at once. 0 = no cap.");
ABSL_FLAG(int, max_tensors_per_uid, 262144,
          "Tensors one uid's sessions may register in all; 0 = no cap.");
ABSL_FLAG(std::string, max_bookkeeping_bytes_per_uid, "256M",
          "Bytes of per-tensor records and names one uid's registrations may make dosd keep; "
          "0 = no cap.");
ABSL_FLAG(std::string, checkpoint_quota, "0", "Bytes each uid's checkpoints may take in the "
          "store (its folder uid-<uid>), e.g. 100G; 0 = no quota.");
ABSL_FLAG(bool, checkpoint_quota_prune, true, "A save beyond --checkpoint_quota first deletes "
          "the uid's oldest checkpoints (never its newest); false: it is refused instead.");
ABSL_FLAG(uint32_t, fd_reserve, 256, "File descriptors (below RLIMIT_NOFILE, raised to its hard "
          "limit at start) kept for uids holding few sessions (< N/32); 0 = none.");

namespace dos {

namespace {

absl::Status Count(const char* flag, int value, uint64_t* out) {
  if (value < 0) return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be >= 0"));
  *out = static_cast<uint64_t>(value);
  return absl::OkStatus();
}

absl::Status Bytes(const char* flag, const std::string& text, uint64_t auto_value,
                   uint64_t* out) {
  if (text == "auto") {
    *out = auto_value;
    return absl::OkStatus();
  }
  if (!ParseBytes(text, out)) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", text,
                                                   " is not a size; write e.g. 64G, 512M, "
                                                   "auto, or 0 for no cap"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status BoundsFromFlags(uint64_t host_memory_limit, absl::Duration session_lease,
                             SessionOptions* session, UidLimits* limits) {
  if (absl::GetFlag(FLAGS_max_sessions) < 0 || absl::GetFlag(FLAGS_max_sessions_per_uid) < 0) {
    return absl::InvalidArgumentError("--max_sessions and --max_sessions_per_uid must be >= 0");
  }
  session->max_sessions = static_cast<uint32_t>(absl::GetFlag(FLAGS_max_sessions));
  session->max_sessions_per_uid = static_cast<uint32_t>(absl::GetFlag(FLAGS_max_sessions_per_uid));
  session->early_ready_timeout = absl::GetFlag(FLAGS_early_step_ready_timeout);
  if (session->early_ready_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--early_step_ready_timeout must be positive (e.g. 60s), or 0 for --session_lease");
  }
  if (session->early_ready_timeout == absl::ZeroDuration()) {
    session->early_ready_timeout =
        session_lease > absl::ZeroDuration() ? session_lease : absl::Seconds(60);
  }
  auto& uid = limits->per_uid;
  auto& per_session = limits->per_session;
  auto at = [](UidResource r) { return static_cast<size_t>(r); };
  const uint64_t host_memory = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                               static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  absl::Status st =
      Bytes("max_mapped_bytes_per_uid", absl::GetFlag(FLAGS_max_mapped_bytes_per_uid),
            std::max(host_memory, host_memory_limit), &uid[at(UidResource::kMappedBytes)]);
  if (st.ok()) {
    st = Bytes("max_mapped_bytes_per_session", absl::GetFlag(FLAGS_max_mapped_bytes_per_session),
               uid[at(UidResource::kMappedBytes)], &per_session[at(UidResource::kMappedBytes)]);
  }
  if (st.ok()) {
    st = Bytes("max_bookkeeping_bytes_per_uid",
               absl::GetFlag(FLAGS_max_bookkeeping_bytes_per_uid), 0,
               &uid[at(UidResource::kBookkeepingBytes)]);
  }
  if (st.ok()) {
    st = Bytes("max_state_bytes_per_uid", absl::GetFlag(FLAGS_max_state_bytes_per_uid), 0,
               &uid[at(UidResource::kStateBytes)]);
  }
  if (st.ok()) {
    st = Count("max_fd_connections_per_uid", absl::GetFlag(FLAGS_max_fd_connections_per_uid),
               &uid[at(UidResource::kConnections)]);
  }
  if (st.ok()) {
    st = Count("max_early_steps_per_uid", absl::GetFlag(FLAGS_max_early_steps_per_uid),
               &uid[at(UidResource::kEarlySteps)]);
  }
  if (st.ok()) {
    st = Count("max_tensors_per_uid", absl::GetFlag(FLAGS_max_tensors_per_uid),
               &uid[at(UidResource::kTensors)]);
  }
  if (st.ok()) {
    st = Count("max_segments_per_uid", absl::GetFlag(FLAGS_max_segments_per_uid),
               &uid[at(UidResource::kSegments)]);
  }
  if (st.ok()) {
    st = Count("max_state_views_per_uid", absl::GetFlag(FLAGS_max_state_views_per_uid),
               &uid[at(UidResource::kStateViews)]);
  }
  return st;
}

absl::Status StoreBoundsFromFlags(UserFoldersOptions* folders, uint32_t* fd_reserve) {
  if (!ParseBytes(absl::GetFlag(FLAGS_checkpoint_quota), &folders->quota_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint_quota=", absl::GetFlag(FLAGS_checkpoint_quota),
        " is not a size; write e.g. 100G or 0"));
  }
  folders->prune = absl::GetFlag(FLAGS_checkpoint_quota_prune);
  *fd_reserve = absl::GetFlag(FLAGS_fd_reserve);
  return absl::OkStatus();
}

}  // namespace dos
