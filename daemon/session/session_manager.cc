#include "daemon/session/session_manager.h"

#include <pthread.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/log.h"

namespace dos {
namespace {
std::string NewToken() {
  std::random_device rd;  // /dev/urandom
  std::string token;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&token, absl::StrFormat("%08x", rd()));
  return token;
}
}  // namespace

SessionManager::SessionManager(const SessionOptions& options, const Policy& default_policy,
                               StepExecutor* executor, HostMemoryBudget* budget)
    : options_(options), executor_(executor), budget_(budget), default_policy_(default_policy) {
  reaper_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "dos-reaper");
    ReapLoop();
  });
}

SessionManager::~SessionManager() { Shutdown(); }

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Attach(SessionIdentity identity) {
  Policy policy;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::UnavailableError("attach: the daemon is shutting down");
    identity.id = next_id_++;
    policy = default_policy_;
  }
  identity.token = NewToken();
  absl::StatusOr<std::unique_ptr<Session>> created =
      Session::Create(identity, options_, policy, executor_, budget_,
                      [this](uint64_t id) { OnClientGone(id); });
  if (!created.ok()) return created.status();
  std::shared_ptr<Session> session = *std::move(created);
  {
    absl::MutexLock lock(&mu_);
    sessions_[identity.id] = session;
  }
  DOS_LOG_INFO("session.attach", "session", identity.id, "client", identity.client_name, "pid",
               identity.pid, "rank", identity.rank, "control_block",
               session->control_block_name());
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::FindUnchecked(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "session ", id, " is not attached (it detached, its client exited, or the daemon "
        "restarted); attach a new session"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Find(uint64_t id,
                                                              absl::string_view token) const {
  absl::StatusOr<std::shared_ptr<Session>> s = FindUnchecked(id);
  if (!s.ok()) return s;
  if (!(*s)->TokenMatches(token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("session ", id, ": wrong token; use the token Attach returned"));
  }
  return s;
}

absl::Status SessionManager::Detach(uint64_t id, absl::string_view token) {
  absl::StatusOr<std::shared_ptr<Session>> s = Find(id, token);
  if (!s.ok()) return s.status();
  {
    absl::MutexLock lock(&mu_);
    sessions_.erase(id);
  }
  StopAndFree(*std::move(s), "detach");
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Session>> SessionManager::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const auto& [id, s] : sessions_) out.push_back(s);
  return out;
}

Policy SessionManager::default_policy() const {
  absl::MutexLock lock(&mu_);
  return default_policy_;
}

void SessionManager::SetDefaultPolicy(const Policy& policy) {
  absl::MutexLock lock(&mu_);
  default_policy_ = policy;
}

void SessionManager::OnClientGone(uint64_t id) {
  absl::MutexLock lock(&mu_);
  gone_.push_back(id);
}

void SessionManager::ReapLoop() {
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return shutdown_ || !gone_.empty(); };
  while (true) {
    std::vector<std::shared_ptr<Session>> reap;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&ready));
      if (shutdown_) return;
      for (uint64_t id : gone_) {
        auto it = sessions_.find(id);
        if (it == sessions_.end()) continue;
        reap.push_back(it->second);
        sessions_.erase(it);
      }
      gone_.clear();
    }
    for (auto& s : reap) StopAndFree(std::move(s), "client_exited");
  }
}

void SessionManager::StopAndFree(std::shared_ptr<Session> session, absl::string_view why) {
  const uint64_t id = session->identity().id;
  session->Stop();
  DOS_LOG_INFO("session.close", "session", id, "reason", why);
  // The last reference frees the state and unmaps the client's memory; an
  // RPC still holding the session delays that until it returns.
  session.reset();
}

void SessionManager::Shutdown() {
  std::map<uint64_t, std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_ && !reaper_.joinable()) return;
    shutdown_ = true;
    sessions.swap(sessions_);
  }
  if (reaper_.joinable()) reaper_.join();
  for (auto& [id, s] : sessions) StopAndFree(std::move(s), "shutdown");
}

}  // namespace dos
