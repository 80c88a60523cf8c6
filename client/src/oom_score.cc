#include "oom_score.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/numbers.h"

namespace dos::client {

void RaiseOomScore(pid_t daemon_pid) {
  int daemon_adj = 0;
  if (std::ifstream d("/proc/" + std::to_string(daemon_pid) + "/oom_score_adj");
      daemon_pid > 0 && (d >> daemon_adj) && daemon_adj <= -500) {
    return;  // dosd is protected already (the unit, or CAP_SYS_RESOURCE)
  }
  int target = kTrainerOomScoreAdj;
  if (const char* env = std::getenv("DOS_TRAINER_OOM_SCORE_ADJ"); env != nullptr && *env) {
    int v = 0;
    if (std::string(env) == "keep" || !absl::SimpleAtoi(env, &v) || v < -1000 || v > 1000) return;
    target = v;
  }
  int current = 0;
  {
    std::ifstream in("/proc/self/oom_score_adj");
    if (!(in >> current) || current >= target) return;
  }
  std::ofstream out("/proc/self/oom_score_adj");
  out << target << std::flush;
}

}  // namespace dos::client
