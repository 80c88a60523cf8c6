// Helpers for the transport tests: unique shm names and fork()ed peers.
//
// A forked peer must not touch gtest (its assertions would report in the
// wrong process); it returns an exit code instead, which the parent checks.
#pragma once

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"

namespace dos::testing {

// "/dos_test.<pid>.<n>.<tag>": distinct across concurrent test processes.
inline std::string UniqueShmName(const char* tag) {
  static std::atomic<int> counter{0};
  return absl::StrCat("/dos_test.", getpid(), ".", counter.fetch_add(1), ".", tag);
}

// Runs fn() in a child process that exits with its return value.
template <typename Fn>
pid_t ForkPeer(Fn fn) {
  pid_t pid = fork();
  if (pid == 0) _exit(fn());
  return pid;
}

// Reaps `pid`; its exit code, or 128 + signal if it was killed, or -1.
inline int WaitExit(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace dos::testing
