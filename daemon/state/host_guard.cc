#include "daemon/state/host_guard.h"
#include "daemon/state/host_memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "daemon/common/log.h"

namespace dos {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// A field of /proc/meminfo in bytes ("MemAvailable:  123 kB").
std::optional<uint64_t> MeminfoBytes(absl::string_view field) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view l(line);
    if (!absl::ConsumePrefix(&l, field) || !absl::ConsumePrefix(&l, ":")) continue;
    l = absl::StripAsciiWhitespace(absl::StripSuffix(absl::StripAsciiWhitespace(l), "kB"));
    uint64_t kb = 0;
    if (absl::SimpleAtoi(l, &kb)) return kb * 1024;
  }
  return std::nullopt;
}

std::optional<uint64_t> FileNumber(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s)) return std::nullopt;
  uint64_t v = 0;
  if (!absl::SimpleAtoi(s, &v)) return std::nullopt;  // "max": no limit
  return v;
}

// What dosd's memory cgroup still allows, if it sets a limit.
std::optional<uint64_t> CgroupRoom(std::string* where, uint64_t* limit_out) {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    // "0::/path" (v2) or "4:memory:/path" (v1)
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    std::optional<uint64_t> limit, used;
    if (controllers.empty()) {
      *where = absl::StrCat("/sys/fs/cgroup", path);
      limit = FileNumber(*where + "/memory.max");
      used = FileNumber(*where + "/memory.current");
    } else if (absl::StrContains(controllers, "memory")) {
      *where = absl::StrCat("/sys/fs/cgroup/memory", path);
      limit = FileNumber(*where + "/memory.limit_in_bytes");
      used = FileNumber(*where + "/memory.usage_in_bytes");
      if (limit && *limit >= (uint64_t{1} << 60)) limit.reset();  // v1's "no limit"
    }
    if (limit && used) {
      *limit_out = *limit;
      return *limit > *used ? *limit - *used : 0;
    }
  }
  return std::nullopt;
}

}  // namespace

namespace {
bool WriteOomScoreAdj(int value) {
  std::ofstream out("/proc/self/oom_score_adj");
  out << value << std::flush;
  return out.good();
}
}  // namespace

void LowerOomScore() {
  if (WriteOomScoreAdj(kDaemonOomScoreAdj)) {
    DOS_LOG_INFO("daemon.oom_score_adj", "value", kDaemonOomScoreAdj);
    return;
  }
  // Without CAP_SYS_RESOURCE a score can still come down to what this
  // process started from: one inherited from a trainer that raised its own
  // (client/src/oom_score.h) goes back to 0.
  int current = 0;
  std::ifstream("/proc/self/oom_score_adj") >> current;
  const bool reset = current > 0 && WriteOomScoreAdj(0);
  DOS_LOG_WARNING("daemon.oom_score_adj_kept", "value", reset ? 0 : current, "message",
                  absl::StrCat("cannot lower dosd's OOM score to ", kDaemonOomScoreAdj,
                               " (/proc/self/oom_score_adj: needs CAP_SYS_RESOURCE); trainers "
                               "raise their own when they attach, but run dosd as the packaged "
                               "service (OOMScoreAdjust=-900) or with CAP_SYS_RESOURCE so the "
                               "kernel's OOM killer never picks it"));
}

std::optional<uint64_t> HostMemoryTotal() { return MeminfoBytes("MemTotal"); }

absl::Status CheckHostCanHold(uint64_t bytes, absl::string_view what) {
  auto refuse = [&](uint64_t room, uint64_t reserve, absl::string_view of) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": the optimizer state needs ", FormatBytes(bytes), " of host memory but ", of,
        " has ", FormatBytes(room), " available (less a reserve of ", FormatBytes(reserve),
        " kept free so that the trainers and dosd are not killed for memory); free host memory, "
        "use compact_state=True (8 bytes a parameter instead of 12), fewer or smaller shards on "
        "this node, or a node with more memory"));
  };
  const uint64_t total = HostMemoryTotal().value_or(0);
  const uint64_t host_reserve = std::max<uint64_t>(kGiB, total / 50);
  if (std::optional<uint64_t> avail = MeminfoBytes("MemAvailable");
      avail && bytes + host_reserve > *avail) {
    return refuse(*avail, host_reserve, "the host (MemAvailable)");
  }
  std::string cgroup;
  uint64_t limit = 0;
  if (std::optional<uint64_t> room = CgroupRoom(&cgroup, &limit)) {
    const uint64_t reserve = std::max<uint64_t>(uint64_t{4} << 20, limit / 50);
    if (bytes + reserve > *room) {
      return refuse(*room, reserve, absl::StrCat("dosd's memory cgroup ", cgroup));
    }
  }
  return absl::OkStatus();
}

}  // namespace dos
