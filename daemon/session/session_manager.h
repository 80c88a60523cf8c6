// SessionManager: the table of attached sessions.
//
// It hands out session ids and tokens, finds sessions for the RPC layer
// (checking tokens), removes them on Detach, and reaps sessions whose client
// process exited (the session's step thread notices and reports it; a reaper
// thread stops and frees the session so its memory returns to the budget).
// Shutdown() drains: every session finishes its in-flight step, then stops.
//
// Thread-safety: all methods are thread-safe; `mu_` guards the table only and
// is never held while a session stops.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/session/session.h"

namespace dos {

class SessionManager {
 public:
  SessionManager(const SessionOptions& options, const Policy& default_policy,
                 StepExecutor* executor, HostMemoryBudget* budget);
  ~SessionManager();  // Shutdown()s.

  absl::StatusOr<std::shared_ptr<Session>> Attach(SessionIdentity identity);
  // NOT_FOUND for an unknown id, PERMISSION_DENIED for a wrong token.
  absl::StatusOr<std::shared_ptr<Session>> Find(uint64_t id, absl::string_view token) const;
  // For operator calls (dosctl) that need no token: read-only views, policy.
  absl::StatusOr<std::shared_ptr<Session>> FindUnchecked(uint64_t id) const;
  absl::Status Detach(uint64_t id, absl::string_view token);
  std::vector<std::shared_ptr<Session>> List() const;

  Policy default_policy() const;
  void SetDefaultPolicy(const Policy& policy);

  void Shutdown();

 private:
  void OnClientGone(uint64_t id);
  void ReapLoop();
  void StopAndFree(std::shared_ptr<Session> session, absl::string_view why);

  const SessionOptions options_;
  StepExecutor* const executor_;
  HostMemoryBudget* const budget_;

  mutable absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> gone_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  Policy default_policy_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace dos
