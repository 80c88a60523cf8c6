#include "daemon/session/session_manager.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <random>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/log.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {
std::string NewToken() {
  std::random_device rd;  // /dev/urandom
  std::string token;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&token, absl::StrFormat("%08x", rd()));
  return token;
}

// " (3 <what>)" for a refusal's message; "" when none are closed.
std::string ClosedNote(uint64_t closed, absl::string_view what) {
  return closed == 0 ? std::string() : absl::StrCat(" (", closed, " ", what, ")");
}
}  // namespace

SessionManager::SessionManager(const SessionOptions& options, const Policy& default_policy,
                               const ExecutorSet* executors, HostMemoryBudget* budget,
                               absl::Duration lease)
    : options_(options),
      executors_(executors),
      budget_(budget),
      lease_(lease),
      default_policy_(default_policy) {
  reaper_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "dos-reaper");
    ReapLoop();
  });
}

SessionManager::~SessionManager() { Shutdown(); }

namespace {
// Only the uid that attached a session, holding its token, resumes it.
absl::Status CheckResume(const Session& s, uint32_t uid, absl::string_view token) {
  if (s.identity().uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat(
        "attach: session ", s.identity().id, " belongs to uid ", s.identity().uid,
        ", not to uid ", uid, "; a session is resumed by the user who attached it"));
  }
  if (!s.TokenMatches(token)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "attach: resume.token does not match session ", s.identity().id,
        "; pass the token the first Attach returned"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Attach(SessionIdentity identity,
                                                                uint64_t resume_id,
                                                                absl::string_view resume_token,
                                                                bool* resumed) {
  if (resumed != nullptr) *resumed = false;
  Policy policy;
  std::shared_ptr<Session> old;  // the orphaned session being resumed
  std::shared_ptr<Session> dying;  // still in the table, its client already dead
  bool creating = false;           // counted in creating_ until it is in sessions_ or failed
  absl::Cleanup uncount = [&] {
    if (!creating) return;
    absl::MutexLock lock(&mu_);
    CreatedLocked(identity.uid);
  };
  LookAgainAtClosedBlocks(identity.uid);
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::UnavailableError("attach: the daemon is shutting down");
    policy = default_policy_;
    if (resume_id == 0) {
      DOS_RETURN_IF_ERROR(CheckCaps(identity.uid));
      identity.id = next_id_++;
      CountCreatingLocked(identity.uid);
      creating = true;
    } else {
      auto live = sessions_.find(resume_id);
      if (live != sessions_.end()) {
        DOS_RETURN_IF_ERROR(CheckResume(*live->second, identity.uid, resume_token));
        if (live->second->identity().ClientAlive()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "attach: session ", resume_id, " is still attached by pid ",
              live->second->identity().pid, "; only a session whose process exited can be "
              "resumed"));
        }
        // Its death is not yet noticed by the step thread: orphan it now.
        dying = live->second;
        sessions_.erase(live);
      } else {
        auto o = orphans_.find(resume_id);
        if (o == orphans_.end()) {
          return absl::NotFoundError(absl::StrCat(
              "attach: resume.session_id ", resume_id, " is not a session waiting for its "
              "trainer (never attached, detached, its lease of ", absl::FormatDuration(lease_),
              " ran out, or the daemon restarted); attach a new session"));
        }
        DOS_RETURN_IF_ERROR(CheckResume(*o->second.session, identity.uid, resume_token));
        old = o->second.session;
        orphans_.erase(o);
      }
    }
  }
  if (dying != nullptr) old = std::move(dying);
  // Lets an in-flight step finish (so the state is at a step boundary) and
  // joins the dead client's step thread; only this caller holds `old` now.
  if (old != nullptr) old->Stop();
  std::vector<std::string> restore;
  Env* restore_env = nullptr;
  if (old != nullptr) {
    identity.id = old->identity().id;
    identity.token = old->identity().token;
    identity.generation = old->identity().generation + 1;
    policy = old->policy();
  } else {
    identity.token = NewToken();
    absl::MutexLock lock(&mu_);
    // Taken once: a second trainer of the same name and rank starts fresh.
    auto it = restore_.find({identity.uid, identity.client_name, identity.rank});
    if (it != restore_.end()) {
      restore = std::move(it->second);
      restore_.erase(it);
      restore_env = restore_env_;
    }
  }
  absl::StatusOr<std::unique_ptr<Session>> created =
      Session::Create(identity, options_, policy, executors_, budget_,
                      [this, gen = identity.generation](uint64_t id) { OnClientGone(id, gen); });
  if (!created.ok()) {
    if (old != nullptr) {
      // Keep the state for another try within the lease.
      absl::MutexLock lock(&mu_);
      orphans_[identity.id] = Orphaned{old, absl::Now() + lease_};
    }
    return created.status();
  }
  std::shared_ptr<Session> session = *std::move(created);
  if (old != nullptr) {
    CheckpointOwner owner = old->StateOwner();  // before TakeShard: whose it is
    session->AdoptShard(old->TakeShard(), std::move(owner));
    if (resumed != nullptr) *resumed = true;
  }
  if (!restore.empty()) session->SetRestoreCandidates(std::move(restore), restore_env);
  {
    absl::MutexLock lock(&mu_);
    sessions_[identity.id] = session;
    if (std::exchange(creating, false)) CreatedLocked(identity.uid);
  }
  DOS_LOG_INFO(old != nullptr ? "session.resume" : "session.attach", "session", identity.id,
               "client", identity.client_name, "pid", identity.pid, "rank", identity.rank,
               "uid", identity.uid);
  return session;
}

absl::Status SessionManager::CheckCaps(uint32_t uid) const {
  // Closed sessions whose control blocks are still mapped count here too: each
  // holds a memfd and a descriptor of dosd's.
  const size_t closed = budget_ != nullptr ? budget_->held_blocks() : 0;
  const size_t total = sessions_.size() + orphans_.size() + closed + creating_total_;
  if (options_.max_sessions != 0 && total >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "attach: dosd holds ", total, " sessions",
        ClosedNote(closed, "closed, their control blocks still mapped"),
        ", its --max_sessions=", options_.max_sessions,
        "; detach finished trainers (dosctl sessions lists them) or raise --max_sessions"));
  }
  if (options_.max_sessions_per_uid != 0) {
    const uint64_t mine = SessionsOfLocked(uid);
    if (mine >= options_.max_sessions_per_uid) {
      const uint64_t closed =
          options_.ledger != nullptr ? options_.ledger->Used(uid, UidResource::kClosedBlocks) : 0;
      return absl::ResourceExhaustedError(absl::StrCat(
          "attach: uid ", uid, " holds ", mine,
          " sessions, dosd's --max_sessions_per_uid=", options_.max_sessions_per_uid,
          ClosedNote(closed,
                     "of them closed, their control blocks still mapped by processes "
                     "of this uid: end those processes or let them unmap the blocks"),
          "; detach sessions you no longer use (dosctl sessions) or ask the operator to raise "
          "--max_sessions_per_uid"));
    }
  }
  return absl::OkStatus();
}

void SessionManager::LookAgainAtClosedBlocks(uint32_t uid) {
  // Control blocks of closed sessions count as sessions (CheckCaps) until
  // they are seen unmapped: a detach's is unmapped only after its Detach call
  // returns, so a close-then-attach (a rebuild) would find its own. Looked at
  // again at an attach (off mu_: freeing what the reap gives back takes time).
  if (budget_ != nullptr && options_.ledger != nullptr &&
      options_.ledger->Used(uid, UidResource::kClosedBlocks) > 0) {
    budget_->ReapViews();
  }
}

void SessionManager::CountCreatingLocked(uint32_t uid) {
  ++creating_[uid];
  ++creating_total_;
}

void SessionManager::CreatedLocked(uint32_t uid) {
  --creating_total_;
  if (--creating_[uid] == 0) creating_.erase(uid);
}

uint64_t SessionManager::SessionsOfLocked(uint32_t uid) const {
  auto c = creating_.find(uid);
  uint64_t n = c == creating_.end() ? 0 : c->second;
  for (const auto& [id, s] : sessions_) n += s->identity().uid == uid ? 1 : 0;
  for (const auto& [id, o] : orphans_) n += o.session->identity().uid == uid ? 1 : 0;
  if (options_.ledger != nullptr) n += options_.ledger->Used(uid, UidResource::kClosedBlocks);
  return n;
}

uint64_t SessionManager::SessionsOf(uint32_t uid) const {
  absl::MutexLock lock(&mu_);
  return SessionsOfLocked(uid);
}

void SessionManager::SetRestoreCandidates(
    std::map<RestoreKey, std::vector<std::string>> candidates, Env* env) {
  absl::MutexLock lock(&mu_);
  restore_ = std::move(candidates);
  restore_env_ = env;
}

void SessionManager::SkipIdsThrough(uint64_t last) {
  absl::MutexLock lock(&mu_);
  next_id_ = std::max(next_id_, last + 1);  // last: at most 2**48 (the scan's bound)
}

absl::Duration SessionManager::OrphanLeaseLeft(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = orphans_.find(id);
  if (it == orphans_.end()) return absl::ZeroDuration();
  return std::max(it->second.deadline - absl::Now(), absl::ZeroDuration());
}

std::vector<std::shared_ptr<Session>> SessionManager::ListOrphans() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const auto& [id, o] : orphans_) out.push_back(o.session);
  return out;
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
    if (KeepAdopted(*s)) return absl::OkStatus();
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

std::map<uint32_t, SessionManager::UidUsage> SessionManager::UsageByUid() const {
  std::map<uint32_t, UidUsage> out;
  if (options_.ledger != nullptr) {
    for (const auto& [uid, u] : options_.ledger->Snapshot()) out[uid].used = u.used;
  }
  absl::MutexLock lock(&mu_);
  for (const auto& [id, s] : sessions_) ++out[s->identity().uid].sessions;
  for (const auto& [id, o] : orphans_) ++out[o.session->identity().uid].sessions;
  for (auto& [uid, u] : out) {  // closed but still mapped: they count as sessions
    u.sessions += static_cast<uint32_t>(u.used[static_cast<size_t>(UidResource::kClosedBlocks)]);
  }
  return out;
}

UidLimits SessionManager::Limits() const {
  return options_.ledger != nullptr ? options_.ledger->limits() : UidLimits{};
}

void SessionManager::SetOnClose(std::function<void(uint64_t)> on_close) {
  absl::MutexLock lock(&mu_);
  on_close_ = std::move(on_close);
}

Policy SessionManager::default_policy() const {
  absl::MutexLock lock(&mu_);
  return default_policy_;
}

void SessionManager::SetDefaultPolicy(const Policy& policy) {
  absl::MutexLock lock(&mu_);
  default_policy_ = policy;
}

void SessionManager::OnClientGone(uint64_t id, uint32_t generation) {
  absl::MutexLock lock(&mu_);
  gone_.emplace_back(id, generation);
}

void SessionManager::ReapLoop() {
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return shutdown_ || !gone_.empty() || !released_.empty();
  };
  // Steady: a wall clock stepped back must not hold the sweep off.
  std::chrono::steady_clock::time_point last_sweep{};
  while (true) {
    std::vector<std::shared_ptr<Session>> reap;
    std::vector<std::shared_ptr<Session>> expired;
    std::vector<std::shared_ptr<Session>> released;  // dropped below, off mu_
    {
      absl::MutexLock lock(&mu_);
      // Wake at least once a second to expire leases.
      mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(1));
      if (shutdown_) return;
      released.swap(released_);
      // Woken only for holds let go (one or two a descriptor request): they
      // are dropped, and the sweep below runs at most once a second.
      const auto now_steady = std::chrono::steady_clock::now();
      if (gone_.empty() && now_steady - last_sweep < std::chrono::seconds(1)) continue;
      last_sweep = now_steady;
      for (auto [id, generation] : gone_) {
        auto it = sessions_.find(id);
        if (it == sessions_.end() || it->second->identity().generation != generation) continue;
        // Only a registered session's step thread reports here; one that holds
        // adopted state unregistered is the check below's.
        if (lease_ > absl::ZeroDuration() && it->second->registered()) {
          // Kept for the lease. Its step thread has returned (it reported the
          // death); whoever takes it out of orphans_ Stop()s (joins) it.
          DOS_LOG_INFO("session.orphaned", "session", id, "pid", it->second->identity().pid,
                       "lease", absl::FormatDuration(lease_));
          orphans_[id] = Orphaned{std::move(it->second), absl::Now() + lease_};
        } else {
          reap.push_back(std::move(it->second));
        }
        sessions_.erase(it);
      }
      gone_.clear();
      // Sessions that never registered have no step thread watching their
      // client: checked here, once a second.
      for (auto it = sessions_.begin(); it != sessions_.end();) {
        if (it->second->ClientGoneWithoutThread()) {
          DOS_LOG_INFO("session.client_gone", "session", it->first, "pid",
                       it->second->identity().pid, "registered", false);
          if (!KeepAdopted(it->second)) reap.push_back(std::move(it->second));
          it = sessions_.erase(it);
        } else {
          ++it;
        }
      }
      const absl::Time now = absl::Now();
      for (auto it = orphans_.begin(); it != orphans_.end();) {
        if (it->second.deadline <= now) {
          expired.push_back(std::move(it->second.session));
          it = orphans_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& s : reap) StopAndFree(std::move(s), "client_exited");
    for (auto& s : expired) StopAndFree(std::move(s), "lease_expired");
    // State of closed sessions whose views their trainers have dropped since.
    if (budget_ != nullptr) budget_->ReapViews();
  }
}

std::shared_ptr<void> SessionManager::HoldForPort(std::shared_ptr<Session> session) {
  auto* held = new std::shared_ptr<Session>(std::move(session));
  return std::shared_ptr<void>(held, [this](std::shared_ptr<Session>* h) {
    std::shared_ptr<Session> last = std::move(*h);
    delete h;
    absl::MutexLock lock(&mu_);
    if (!shutdown_) released_.push_back(std::move(last));
    // else: dropped here, after mu_ (declared first, released last)
  });
}

bool SessionManager::KeepAdopted(std::shared_ptr<Session>& s) {
  if (lease_ <= absl::ZeroDuration() || !s->HoldsAdoptedState()) return false;
  const uint64_t id = s->identity().id;
  DOS_LOG_INFO("session.orphaned", "session", id, "pid", s->identity().pid, "lease",
               absl::FormatDuration(lease_), "registered", false);
  orphans_[id] = Orphaned{std::move(s), absl::Now() + lease_};
  return true;
}

void SessionManager::StopAndFree(std::shared_ptr<Session> session, absl::string_view why) {
  const uint64_t id = session->identity().id;
  session->Stop();
  DOS_LOG_INFO("session.close", "session", id, "uid", session->identity().uid, "reason", why);
  std::function<void(uint64_t)> on_close;
  {
    absl::MutexLock lock(&mu_);
    on_close = on_close_;
  }
  if (on_close) on_close(id);
  // The last reference frees the state and unmaps the client's memory; an
  // RPC still holding the session delays that until it returns.
  session.reset();
}

void SessionManager::StopTakingSteps() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, s] : sessions_) s->RequestStop();
  for (auto& [id, o] : orphans_) o.session->RequestStop();
}

void SessionManager::Shutdown() {
  std::map<uint64_t, std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_ && !reaper_.joinable()) return;
    shutdown_ = true;
    sessions.swap(sessions_);
    for (auto& [id, o] : orphans_) sessions[id] = std::move(o.session);
    orphans_.clear();
  }
  if (reaper_.joinable()) reaper_.join();
  std::vector<std::shared_ptr<Session>> released;
  {
    absl::MutexLock lock(&mu_);
    released.swap(released_);
  }
  released.clear();
  // Every step thread is told first, so their in-flight steps and liveness
  // waits end together; then each is joined and freed, on a few threads
  // (freeing large state and unmapping segments takes a while per session).
  for (auto& [id, s] : sessions) s->RequestStop();
  std::vector<std::shared_ptr<Session>> all;
  for (auto& [id, s] : sessions) all.push_back(std::move(s));
  sessions.clear();
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < all.size();) StopAndFree(std::move(all[i]), "shutdown");
  };
  const size_t n = std::min<size_t>(8, all.size());
  std::vector<std::thread> pool;
  for (size_t k = 1; k < n; ++k) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

}  // namespace dos
