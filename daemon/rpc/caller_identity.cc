#include "daemon/rpc/caller_identity.h"

#include <grp.h>
#include <sys/stat.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace dos {

void PeerTable::Record(int fd, ino_t inode, CallerIdentity id) {
  absl::MutexLock lock(&mu_);
  entries_[fd] = Entry{inode, std::move(id)};
}

size_t PeerTable::Connections(uid_t uid) {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    struct stat st;
    if (::fstat(it->first, &st) != 0 || st.st_ino != it->second.inode) {
      it = entries_.erase(it);  // gRPC closed it (the number may be reused)
      continue;
    }
    n += it->second.id.known && it->second.id.uid == uid ? 1 : 0;
    ++it;
  }
  return n;
}

CallerIdentity PeerTable::Lookup(absl::string_view peer) const {
  CallerIdentity unknown;
  unknown.peer = std::string(peer);
  int fd = -1;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &fd)) return unknown;
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return unknown;
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(fd);
  if (it == entries_.end() || it->second.inode != st.st_ino) return unknown;
  CallerIdentity id = it->second.id;
  id.peer = unknown.peer;
  return id;
}

bool ParseGroupList(absl::string_view text, std::vector<gid_t>* out) {
  out->clear();
  for (absl::string_view g : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::string name(g);
    const struct group* gr = ::getgrnam(name.c_str());
    uint32_t gid = 0;
    if (gr != nullptr) {
      out->push_back(gr->gr_gid);
    } else if (absl::SimpleAtoi(name, &gid)) {
      out->push_back(gid);
    } else {
      return false;
    }
  }
  return true;
}

bool Authorizer::IsOperator(const CallerIdentity& c) const {
  if (!c.known) return options_.tcp_operator_calls;
  if (c.uid == 0 || c.uid == options_.daemon_uid) return true;
  const auto& ops = options_.operator_gids;
  if (std::find(ops.begin(), ops.end(), c.gid) != ops.end()) return true;
  return std::any_of(c.groups.begin(), c.groups.end(), [&ops](gid_t g) {
    return std::find(ops.begin(), ops.end(), g) != ops.end();
  });
}

namespace {
std::string Who(const CallerIdentity& c) {
  return c.known ? absl::StrCat("uid ", c.uid) : absl::StrCat("an unidentified caller (", c.peer, ")");
}
}  // namespace

absl::Status Authorizer::MayActOn(const CallerIdentity& c, uid_t owner, uint64_t session_id,
                                  absl::string_view what) const {
  if (IsOperator(c) || (c.known && c.uid == owner)) return absl::OkStatus();
  if (!c.known) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": session ", session_id, " belongs to uid ", owner, "; calls over the TCP listener "
        "carry no identity and may only read (GetStats, ListSessions, GetPolicy); use the unix "
        "socket as uid ", owner, " or an operator, or start dosd with --tcp_operator_calls"));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      what, ": session ", session_id, " belongs to uid ", owner, ", and ", Who(c),
      " is neither its owner nor an operator (root, dosd's uid ", options_.daemon_uid,
      ", or a member of dosd's --operator_gids", options_.operator_gids.empty() ? "" : "=",
      absl::StrJoin(options_.operator_gids, ","), "); run it as uid ", owner,
      " or ask the operator to add your group to --operator_gids"));
}

absl::Status Authorizer::MustBeOperator(const CallerIdentity& c, absl::string_view what) const {
  if (IsOperator(c)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, " acts on every session and needs an operator (root, dosd's uid ",
      options_.daemon_uid, ", or a member of dosd's --operator_gids", 
      options_.operator_gids.empty() ? "" : "=", absl::StrJoin(options_.operator_gids, ","),
      "); ", Who(c), " is not one", c.known ? "" : " (TCP callers are operators only with "
      "--tcp_operator_calls)", "; name one of your own sessions instead"));
}

bool ParseIdList(absl::string_view text, std::vector<uint32_t>* out) {
  out->clear();
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    uint32_t v;
    if (!absl::SimpleAtoi(part, &v)) return false;
    out->push_back(v);
  }
  return true;
}

absl::Status Authorizer::MayAttach(uid_t uid, gid_t gid, const std::vector<gid_t>& groups) const {
  const auto& uids = options_.allow_uids;
  const auto& gids = options_.allow_gids;
  if (uids.empty() && gids.empty()) return absl::OkStatus();
  auto has = [](const auto& v, auto x) { return std::find(v.begin(), v.end(), x) != v.end(); };
  if (has(uids, uid) || has(gids, gid)) return absl::OkStatus();
  for (gid_t g : groups) {
    if (has(gids, g)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "attach: uid ", uid, " (gid ", gid, groups.empty() ? "" : ", groups ",
      absl::StrJoin(groups, ","), ") is not in dosd's --allow_uids=", absl::StrJoin(uids, ","),
      " / --allow_gids=", absl::StrJoin(gids, ","), "; ask the operator to add it"));
}

absl::Status Authorizer::MustBeLocal(const CallerIdentity& c, absl::string_view what) const {
  if (c.known) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, ": ", Who(c), " has no kernel credentials; trainers attach over dosd's unix socket "
      "(DOS_SOCKET), not the TCP listener"));
}

}  // namespace dos
