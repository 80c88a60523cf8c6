#include "dos/wire/socket_access.h"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dos {
namespace {

std::string GroupName(gid_t gid) {
  struct group gr;
  struct group* found = nullptr;
  std::vector<char> buf(16384);
  if (::getgrgid_r(gid, &gr, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    return found->gr_name;
  }
  return absl::StrCat("gid ", gid);
}

// The account this process runs as: its name ("" when it has none) and
// primary group.
struct Account {
  std::string name;
  gid_t primary = 0;
};

Account ThisAccount() {
  Account a;
  struct passwd pw;
  struct passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (::getpwuid_r(::geteuid(), &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    a.name = found->pw_name;
    a.primary = found->pw_gid;
  }
  return a;
}

// Whether this process (effective or supplementary groups) is in `gid`.
bool ProcessInGroup(gid_t gid) {
  if (::getegid() == gid) return true;
  const int n = ::getgroups(0, nullptr);
  if (n <= 0) return false;
  std::vector<gid_t> groups(n);
  const int got = ::getgroups(n, groups.data());
  for (int i = 0; i < got; ++i) {
    if (groups[i] == gid) return true;
  }
  return false;
}

// Whether the group database puts `account` in `gid` (what its next login gets).
bool AccountInGroup(const Account& account, gid_t gid) {
  if (account.name.empty()) return false;
  if (account.primary == gid) return true;
  int n = 64;
  std::vector<gid_t> groups(n);
  while (::getgrouplist(account.name.c_str(), account.primary, groups.data(), &n) < 0) {
    if (n <= static_cast<int>(groups.size())) return false;  // not a size problem
    groups.resize(n);
  }
  for (int i = 0; i < n; ++i) {
    if (groups[i] == gid) return true;
  }
  return false;
}

// PERMISSION_DENIED: `blocker` (a folder on the way to `socket`, or the
// socket itself) refuses this process; names its mode and group and the fix.
absl::Status Refused(const std::string& socket, const std::string& blocker) {
  const bool is_socket = blocker == socket;
  std::string what = absl::StrCat(is_socket ? "the socket " : "the folder ", blocker);
  struct stat st;
  if (::stat(blocker.c_str(), &st) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot reach dosd's socket ", socket, ": ", what, " refuses this process (",
        std::strerror(EACCES), "); ask whoever runs dosd which group may use it"));
  }
  const Account me = ThisAccount();
  const std::string user = me.name.empty() ? absl::StrCat("uid ", ::geteuid()) : me.name;
  const std::string group = GroupName(st.st_gid);
  std::string msg = absl::StrFormat(
      "cannot reach dosd's socket %s: %s (mode %04o, group %s) does not let %s in", socket, what,
      st.st_mode & 07777, group, user);
  if (ProcessInGroup(st.st_gid)) {
    absl::StrAppend(&msg, "; this process is in group ", group, " already: ask whoever runs "
                    "dosd to open it to the group (--socket_mode=0660 and a folder of mode "
                    "0750, as the packaged service has)");
  } else if (AccountInGroup(me, st.st_gid)) {
    absl::StrAppend(&msg, "; ", user, " is in group ", group, " but this login is not (it "
                    "began before the user was added to the group): log in again (or run `newgrp ",
                    group, "`) and retry");
  } else {
    absl::StrAppend(&msg, "; ", user, " is not in group ", group, ": sudo usermod -aG ", group,
                    " ", me.name.empty() ? "USER" : me.name,
                    ", then log in again (a login keeps the groups it began with)");
  }
  return absl::PermissionDeniedError(msg);
}

// The first folder on the way to `path` this process may not enter ("" if
// none does refuse it).
std::string FirstRefusingFolder(const std::string& path) {
  std::string prefix = path[0] == '/' ? "/" : ".";
  size_t pos = path[0] == '/' ? 1 : 0;
  while (true) {
    if (::faccessat(AT_FDCWD, prefix.c_str(), X_OK, AT_EACCESS) != 0 && errno == EACCES) {
      return prefix;
    }
    const size_t slash = path.find('/', pos);
    if (slash == std::string::npos) return "";
    if (slash > pos) prefix = path.substr(0, slash);
    pos = slash + 1;
  }
}

}  // namespace

absl::Status CheckDaemonSocket(const std::string& path) {
  if (path.empty()) {
    return absl::InvalidArgumentError("dosd's socket path is empty; set DOS_SOCKET or --socket");
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == EACCES) {
      const std::string folder = FirstRefusingFolder(path);
      return Refused(path, folder.empty() ? path : folder);
    }
    if (err == ENOENT || err == ENOTDIR) {
      return absl::UnavailableError(absl::StrCat(
          "no dosd socket at ", path, ": start the daemon (systemctl start dosd, or dosd "
          "--socket=", path, ") or point DOS_SOCKET (dosctl: --socket) at a running one's"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot reach dosd's socket ", path, ": ", std::strerror(err)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a socket; point DOS_SOCKET (dosctl: --socket) at dosd's socket "
        "(its --socket; the packaged service's is /run/dos/dosd.sock)"));
  }
  if (::faccessat(AT_FDCWD, path.c_str(), W_OK, AT_EACCESS) != 0 && errno == EACCES) {
    return Refused(path, path);
  }
  return absl::OkStatus();
}

}  // namespace dos
