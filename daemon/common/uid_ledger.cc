#include "daemon/common/uid_ledger.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dos {
namespace {

struct ResourceText {
  const char* name;
  const char* uid_flag;
  const char* session_flag;
  bool bytes;
  const char* fix;
};

const ResourceText& Text(UidResource r) {
  static const ResourceText kTexts[kNumUidResources] = {
      {"mapped_bytes", "--max_mapped_bytes_per_uid", "--max_mapped_bytes_per_session", true,
       "send dosd only the buffers your tensors lie in, sized to them (free other sessions' "
       "buffers by detaching them)"},
      {"connections", "--max_fd_connections_per_uid", "", false,
       "connect to the descriptor socket only to send a request, and close idle connections"},
      {"early_steps", "--max_early_steps_per_uid", "", false,
       "give the early steps your other sessions have in flight their verdicts "
       "(dos_step_verdict / dos_step_abandon) or detach stalled trainers"},
      {"bookkeeping_bytes", "--max_bookkeeping_bytes_per_uid", "", true,
       "register fewer tensors (flatten small ones into one buffer) with shorter names, or "
       "detach sessions you no longer use"},
      {"tensors", "--max_tensors_per_uid", "", false,
       "register fewer tensors (flatten small ones into one buffer), or detach sessions you "
       "no longer use"},
      {"segments", "--max_segments_per_uid", "", false,
       "send dosd a few large buffers holding your tensors, not one per tensor (libdos_client "
       "does), and detach sessions you no longer use"},
      {"state_views", "--max_state_views_per_uid", "", false,
       "close optimizers you no longer use (each one whose state_dict() was taken counts "
       "until it is closed), and drop the state_dict() results of closed ones (they map their "
       "sessions' state) or end the trainer that holds them"},
      {"state_bytes", "--max_state_bytes_per_uid", "", true,
       "detach sessions you no longer use (a trainer that exited without detaching keeps its "
       "state for --session_lease), drop state_dict() results of closed optimizers, or "
       "register a smaller shard (more ranks, compact_state=True)"},
      {"closed_control_blocks", "--max_sessions_per_uid", "", false,
       "end the processes that still map closed sessions' control blocks (each counts as one "
       "of your sessions until it is unmapped)"},
  };
  return kTexts[static_cast<int>(r)];
}

std::string Amount(UidResource r, uint64_t n) {
  if (!Text(r).bytes) return absl::StrCat(n);
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(n, " B") : absl::StrFormat("%.2f %s", v, kUnits[u]);
}

}  // namespace

const char* UidResourceName(UidResource r) { return Text(r).name; }

LedgerCharge& LedgerCharge::operator=(LedgerCharge&& o) noexcept {
  if (this == &o) return *this;
  Reset();
  ledger_ = std::exchange(o.ledger_, nullptr);
  uid_ = o.uid_;
  account_ = std::move(o.account_);
  resource_ = o.resource_;
  amount_ = std::exchange(o.amount_, 0);
  return *this;
}

void LedgerCharge::Reset() {
  if (ledger_ != nullptr && amount_ != 0) {
    ledger_->Release(uid_, static_cast<UidLedger::Account*>(account_.get()), resource_, amount_);
  }
  ledger_ = nullptr;
  account_.reset();
  amount_ = 0;
}

UidLedger::Account::~Account() { ledger_->CloseAccount(uid_); }

std::shared_ptr<UidLedger::Account> UidLedger::OpenAccount(uint32_t uid, uint64_t session_id) {
  std::shared_ptr<Account> a(new Account(this, uid, session_id));
  a->self_ = a;
  absl::MutexLock lock(&mu_);
  ++usage_[uid].accounts;
  return a;
}

void UidLedger::CloseAccount(uint32_t uid) {
  absl::MutexLock lock(&mu_);
  auto it = usage_.find(uid);
  if (it == usage_.end()) return;
  if (it->second.accounts > 0) --it->second.accounts;
  if (it->second.accounts == 0 && it->second.used == UidAmounts{}) usage_.erase(it);
}

absl::StatusOr<LedgerCharge> UidLedger::Account::Charge(UidResource r, uint64_t amount,
                                                        absl::string_view what) {
  absl::MutexLock lock(&ledger_->mu_);
  const int i = static_cast<int>(r);
  const uint64_t cap = ledger_->limits_.per_session[i];
  if (cap != 0 && amount > cap - std::min(cap, used_[i])) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": session ", session_id_, " (uid ", uid_, ") holds ", Amount(r, used_[i]), " of ",
        Text(r).name, " and this needs ", Amount(r, amount), " more, past dosd's ",
        Text(r).session_flag, "=", Amount(r, cap), "; ", Text(r).fix,
        ", or ask the operator to raise ", Text(r).session_flag));
  }
  absl::StatusOr<LedgerCharge> c = ledger_->ChargeLocked(uid_, self_.lock(), r, amount, what);
  if (c.ok()) used_[i] += amount;
  return c;
}

uint64_t UidLedger::Account::used(UidResource r) const {
  absl::MutexLock lock(&ledger_->mu_);
  return used_[static_cast<int>(r)];
}

absl::StatusOr<LedgerCharge> UidLedger::Charge(uint32_t uid, UidResource r, uint64_t amount,
                                               absl::string_view what) {
  absl::MutexLock lock(&mu_);
  return ChargeLocked(uid, nullptr, r, amount, what);
}

absl::StatusOr<LedgerCharge> UidLedger::ChargeLocked(uint32_t uid,
                                                     std::shared_ptr<Account> account,
                                                     UidResource r, uint64_t amount,
                                                     absl::string_view what) {
  const int i = static_cast<int>(r);
  const uint64_t cap = limits_.per_uid[i];
  const uint64_t used = usage_.count(uid) != 0 ? usage_[uid].used[i] : 0;
  if (cap != 0 && amount > cap - std::min(cap, used)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": uid ", uid, " holds ", Amount(r, used), " of ", Text(r).name,
        " and this needs ", Amount(r, amount), " more, past dosd's ", Text(r).uid_flag, "=",
        Amount(r, cap), "; ", Text(r).fix, ", or ask the operator to raise ", Text(r).uid_flag));
  }
  usage_[uid].used[i] += amount;
  LedgerCharge c;
  c.ledger_ = this;
  c.uid_ = uid;
  c.account_ = std::move(account);
  c.resource_ = r;
  c.amount_ = amount;
  return c;
}

void UidLedger::Release(uint32_t uid, Account* account, UidResource r, uint64_t amount) {
  absl::MutexLock lock(&mu_);
  const int i = static_cast<int>(r);
  if (account != nullptr) account->used_[i] -= std::min(account->used_[i], amount);
  auto it = usage_.find(uid);
  if (it == usage_.end()) return;
  it->second.used[i] -= std::min(it->second.used[i], amount);
  if (it->second.accounts == 0 && it->second.used == UidAmounts{}) usage_.erase(it);
}

uint64_t UidLedger::Used(uint32_t uid, UidResource r) const {
  absl::MutexLock lock(&mu_);
  auto it = usage_.find(uid);
  return it == usage_.end() ? 0 : it->second.used[static_cast<size_t>(r)];
}

std::map<uint32_t, UidLedger::Usage> UidLedger::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return usage_;
}

}  // namespace dos
