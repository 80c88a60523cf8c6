// DaemonProcess: starts the real dosd binary on a temporary socket for an
// integration test and stops it with SIGTERM, as a user or systemd would.
//
// Thread-safety: not thread-safe; one per test.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace dos::testing {

class DaemonProcess {
 public:
  // `extra_flags` are appended to dosd's command line.
  explicit DaemonProcess(std::vector<std::string> extra_flags = {});
  ~DaemonProcess();  // SIGKILLs the daemon if it still runs.

  // Runs dosd as `uid`:`gid` (no supplementary groups) with `umask`, as the
  // systemd unit does (User=, Group=, UMask=); needs root. Call before Start():
  // the temporary directory is handed to that user (mode 0750: the group may
  // reach the socket, others may not, like /run/dos).
  // `binary`, if not empty, replaces the dosd to run (a copy that user can
  // execute).
  void RunAs(uid_t uid, gid_t gid, mode_t umask, std::string binary = "");

  // Starts dosd and waits (with a deadline) until its socket accepts
  // connections. Returns false if it exits or never listens.
  bool Start();
  // Sends SIGTERM and waits; returns the exit status (-1 on timeout).
  int Stop();
  // SIGKILLs dosd (a crash: nothing is drained or cleaned up) and reaps it.
  void Kill();
  // Waits for dosd to exit on its own; returns its exit status.
  int WaitExit(int timeout_ms);

  const std::string& socket() const { return socket_; }
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }
  std::string log() const;  // what dosd wrote to stderr so far

 private:
  std::string dir_;
  std::string socket_;
  std::string log_path_;
  std::vector<std::string> flags_;
  pid_t pid_ = -1;
  bool run_as_ = false;
  uid_t uid_ = 0;
  gid_t gid_ = 0;
  mode_t umask_ = 022;
  std::string binary_;
};

// A fresh folder /tmp/<prefix>-XXXXXX, removed with everything in it when
// the TempDir goes (DOS_KEEP_TEST_DIRS=1 keeps it), so test runs leave
// nothing behind in /tmp.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// True once a unix socket at `path` accepts a connection.
// A ticket from dosd's descriptor socket beside `socket` for this process
// (what a raw Attach must carry in fd_ticket); "" if it cannot be had.
std::string FdTicket(const std::string& socket);
bool SocketAccepts(const std::string& path);

}  // namespace dos::testing
