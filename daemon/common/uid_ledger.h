// UidLedger: what each uid (and each of its sessions) holds of the resources
// a client can make dosd hold, against their bounds, so that no trainer can
// starve the others (README, threat model).
//
// Resources (UidResource): bytes of the client's memory dosd maps (segments
// sent over the descriptor socket), descriptor-socket connections being
// served, early steps waiting for their trainer, bookkeeping bytes of
// registered tensors (records and names), registered tensors, and segments
// mapped: each is one mapping of dosd's address space, and the kernel's
// vm.max_map_count (65530 by default) bounds them all together, so one
// uid's thousands of tiny segments would leave none for anyone; and shards
// whose state memory the uid was handed (state_dict()'s zero-copy views):
// one descriptor of dosd's each once their session is gone, kept while the
// trainer still maps them (HostMemoryBudget::HoldWhileViewed); and control
// blocks of the uid's closed sessions that a process still maps (the same).
// Sessions per uid are the session manager's (--max_sessions_per_uid); it
// counts the closed control blocks among them.
//
// Charging: a component charges a uid (Charge) or, for per-session bounds
// too, a session's Account (Account::Charge). Either answers a LedgerCharge
// that gives the amount back when destroyed, or RESOURCE_EXHAUSTED naming
// the uid, what it holds, the flag that bounds it and what to do. Nothing is
// charged on failure. A bound of 0 means no cap.
//
// Ownership: the ledger outlives every Account and LedgerCharge (main.cc
// builds it before the servers and the session manager); an Account lives as
// long as its session or any charge made through it.
//
// Thread-safety: thread-safe; one mutex guards every counter (charges are
// rare: a registration, a segment, a connection, an early step).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace dos {

enum class UidResource : int {
  kMappedBytes = 0,       // client memory mapped (segments), bytes
  kConnections = 1,       // descriptor-socket connections being served
  kEarlySteps = 2,        // early steps waiting for their trainer
  kBookkeepingBytes = 3,  // registered tensors' records and names, bytes
  kTensors = 4,           // registered tensors
  kSegments = 5,          // client memory segments mapped (one mapping of dosd's each)
  kStateViews = 6,        // shards whose state memory the uid was handed (state_dict()'s
                          // views), live or closed while still mapped
  kStateBytes = 7,        // host memory of the uid's optimizer state (its shards' page-aligned
                          // subgroups), live, waiting for a resume, or closed and still viewed
  kClosedBlocks = 8,      // control blocks of closed sessions that a process still maps (each
                          // holds its memfd and one descriptor of dosd's); counted as sessions
                          // against --max_sessions_per_uid, not capped here
};
inline constexpr int kNumUidResources = 9;

// "mapped_bytes", "connections", ...: stats and metrics names.
const char* UidResourceName(UidResource r);

using UidAmounts = std::array<uint64_t, kNumUidResources>;

struct UidLimits {
  UidAmounts per_uid{};      // 0: no cap
  UidAmounts per_session{};  // 0: no cap (only kMappedBytes is bounded per session)
};

class UidLedger;

// An amount charged; given back when destroyed. Movable, not copyable.
class LedgerCharge {
 public:
  LedgerCharge() = default;
  LedgerCharge(LedgerCharge&& o) noexcept { *this = std::move(o); }
  LedgerCharge& operator=(LedgerCharge&& o) noexcept;
  LedgerCharge(const LedgerCharge&) = delete;
  LedgerCharge& operator=(const LedgerCharge&) = delete;
  ~LedgerCharge() { Reset(); }
  void Reset();
  uint64_t amount() const { return amount_; }

 private:
  friend class UidLedger;
  UidLedger* ledger_ = nullptr;
  uint32_t uid_ = 0;
  std::shared_ptr<void> account_;  // a UidLedger::Account, or null: the uid only
  UidResource resource_ = UidResource::kMappedBytes;
  uint64_t amount_ = 0;
};

class UidLedger {
 public:
  // One session's share of its uid's usage (per-session bounds).
  class Account {
   public:
    // Charges the session and its uid; RESOURCE_EXHAUSTED (naming `what`)
    // past either bound.
    absl::StatusOr<LedgerCharge> Charge(UidResource r, uint64_t amount, absl::string_view what);
    uint64_t used(UidResource r) const;
    uint32_t uid() const { return uid_; }
    // The ledger, for charges that outlive the session (UidLedger::Charge).
    UidLedger* ledger() const { return ledger_; }

    ~Account();

   private:
    friend class UidLedger;
    Account(UidLedger* ledger, uint32_t uid, uint64_t session_id)
        : ledger_(ledger), uid_(uid), session_id_(session_id) {}
    UidLedger* const ledger_;
    const uint32_t uid_;
    const uint64_t session_id_;
    UidAmounts used_{};  // guarded by ledger_->mu_
    std::weak_ptr<Account> self_;
  };

  struct Usage {
    UidAmounts used{};
    uint32_t accounts = 0;  // sessions with an open account
  };

  explicit UidLedger(UidLimits limits) : limits_(limits) {}
  UidLedger(const UidLedger&) = delete;
  UidLedger& operator=(const UidLedger&) = delete;

  std::shared_ptr<Account> OpenAccount(uint32_t uid, uint64_t session_id);
  // Charges `uid` alone (connections, before any session is known).
  absl::StatusOr<LedgerCharge> Charge(uint32_t uid, UidResource r, uint64_t amount,
                                      absl::string_view what);

  // Per uid with anything charged or an open account.
  std::map<uint32_t, Usage> Snapshot() const;
  // What `uid` holds of `r` now.
  uint64_t Used(uint32_t uid, UidResource r) const;
  const UidLimits& limits() const { return limits_; }

 private:
  friend class LedgerCharge;
  absl::StatusOr<LedgerCharge> ChargeLocked(uint32_t uid, std::shared_ptr<Account> account,
                                            UidResource r, uint64_t amount,
                                            absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(uint32_t uid, Account* account, UidResource r, uint64_t amount);
  void CloseAccount(uint32_t uid);

  const UidLimits limits_;
  mutable absl::Mutex mu_;
  std::map<uint32_t, Usage> usage_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dos
