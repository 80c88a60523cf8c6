#include "daemon/common/fd_limits.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"

namespace dos {

FileLimit RaiseFileLimit() {
  FileLimit out;
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    DOS_LOG_WARNING("daemon.file_limit", "error", std::strerror(errno));
    return out;
  }
  out.soft_before = rl.rlim_cur;
  out.hard = rl.rlim_max;
  if (rl.rlim_cur < rl.rlim_max) {
    rlimit raised = rl;
    raised.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
  }
  out.soft = rl.rlim_cur;
  DOS_LOG_INFO("daemon.file_limit", "soft_before", out.soft_before, "soft", out.soft, "hard",
               out.hard);
  return out;
}

FdReserve FdReserve::AtStart(uint64_t reserve) {
  const FileLimit files = RaiseFileLimit();
  return FdReserve(files.soft, std::min<uint64_t>(reserve, files.soft / 4));
}

absl::Status FdReserve::Admit(int fd, uint32_t uid, uint64_t sessions) const {
  if (sessions < few_sessions() || !InReserve(fd)) return absl::OkStatus();
  absl::Status st = absl::ResourceExhaustedError(absl::StrCat(
      "dosd is short of file descriptors (about ", fd, " of its limit ", limit_,
      " in use; the last ", reserve_, " (--fd_reserve) are kept for users who hold fewer than ",
      few_sessions(), " sessions), and uid ", uid, " holds ", sessions,
      "; detach sessions you no longer use, or ask the operator to raise dosd's LimitNOFILE "
      "(or lower --max_sessions_per_uid)"));
  DOS_LOG_WARNING("daemon.fd_reserve_refused", "uid", uid, "sessions", sessions, "fd", fd,
                  "limit", limit_, "reserve", reserve_);
  return st;
}

void LogOutOfDescriptors(absl::string_view where, int err) {
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  DOS_LOG_WARNING("daemon.out_of_descriptors", "where", where, "error", std::strerror(err),
                  "limit", static_cast<uint64_t>(rl.rlim_cur), "fix",
                  "raise dosd's LimitNOFILE or lower --max_sessions_per_uid; dosctl sessions "
                  "shows who holds sessions");
}

}  // namespace dos
