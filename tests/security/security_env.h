// The `security` test fixture: throwaway users (tests/security/users.sh, run
// by ctest as the fixture `dos_security_users` before the tests and removed
// after), dosd running as its own user the way the systemd unit runs it, and
// trainer or operator processes (sec_client) running as those users.
//
//   group dos-sec: the trainers' group (the role of `dos`)
//   dos-sec-d: dosd's user; dos-sec-a and dos-sec-e: trainers, primary group
//   dos-sec;
//   dos-sec-b: trainer, dos-sec by supplementary membership; dos-sec-c: a
//   local user outside the group; dos-sec-o: an operator (group dos-sec-op).
//
// Every test starts with DOS_SECURITY_REQUIRE() (skips with the reason when
// not root or the users are missing).
//
// Thread-safety: none; one test at a time per process.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/daemon_process.h"

namespace dos::testing {

struct SecUser {
  std::string name;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary
};

// "" when the fixture is usable; else why not (not root, users missing).
std::string SecuritySkipReason();
#define DOS_SECURITY_REQUIRE()                                                  \
  do {                                                                          \
    if (std::string why = ::dos::testing::SecuritySkipReason(); !why.empty()) { \
      GTEST_SKIP() << why;                                                      \
    }                                                                           \
  } while (0)

// Looks up a fixture user ("dos-sec-a", ...) or group ("dos-sec").
SecUser User(const std::string& name);
gid_t Group(const std::string& name);

// dosd as dos-sec-d (primary group dos-sec), UMask=0007, --group=dos-sec,
// --socket_mode=0660, plus `flags`; not started.
std::unique_ptr<DaemonProcess> SecureDaemon(std::vector<std::string> flags = {});

// A test with dosd as dos-sec-d (daemon_) and the folders it makes around it.
// TearDown stops dosd, expecting a clean exit, after the test's trainers have
// ended, and removes the folders.
class SecureDaemonTest : public ::testing::Test {
 protected:
  // Starts dosd with `flags` (a store that outlives one dosd: pass the same
  // --checkpoint_dir again after StopDaemon()).
  void StartDaemon(std::vector<std::string> flags = {});
  void StopDaemon();
  void TearDown() override;
  // A folder dosd's user owns (mode 0700), for a checkpoint store that
  // outlives one daemon or a place outside the store; removed at TearDown.
  std::string DaemonOwnedDir(const std::string& what);

  std::unique_ptr<DaemonProcess> daemon_;
  std::vector<std::string> dirs_;
};

// A sec_client process running as `user` (see sec_client.cc for the ops).
class UserProcess {
 public:
  UserProcess(const SecUser& user, const std::string& target, std::vector<std::string> ops);
  // Any program speaking the same "OK <op>" / "ERR <op>" lines (argv[0]: a
  // path `user` can execute, see ReachableBinary).
  UserProcess(const SecUser& user, std::vector<std::string> argv);
  ~UserProcess();  // closes stdin, SIGKILLs after a deadline, reaps
  UserProcess(const UserProcess&) = delete;
  UserProcess& operator=(const UserProcess&) = delete;

  // The next stdout line that starts with "OK <op>" or "ERR <op>" (earlier
  // lines are kept in output()); "" if none within `timeout_ms`.
  std::string Await(const std::string& op, int timeout_ms = 20000);
  // Ends the current `wait` (a newline on its stdin); the process goes on to
  // its next ops.
  void Continue();
  // Closes stdin (ends `wait`), reads the rest, waits; returns all output.
  std::string Finish(int timeout_ms = 20000);
  void Kill();
  pid_t pid() const { return pid_; }
  const std::string& output() const { return out_; }

 private:
  bool ReadMore(int timeout_ms);
  pid_t pid_ = -1;
  int in_ = -1;
  int outfd_ = -1;
  std::string out_;
  size_t consumed_ = 0;
};

// Runs sec_client as `user` to completion; returns its stdout.
std::string RunAs(const SecUser& user, const std::string& target, std::vector<std::string> ops);

// Runs `argv` as `user` to completion; returns stdout and stderr together.
std::string RunCommandAs(const SecUser& user, std::vector<std::string> argv);

// Value of `key=` in an "OK ..." line ("" if absent).
std::string Field(const std::string& line, const std::string& key);
// The gRPC code of an "ERR ... code=N" line, 0 for "OK", -1 for anything else.
int Code(const std::string& line);

// Path of a build-tree binary that `user`s can execute (copied to a
// world-readable temporary directory when the build tree is private).
std::string ReachableBinary(const std::string& path);
// The argv of a client binary run as a fixture user: ReachableBinary(binary),
// then `target` (a socket or address), then `ops`.
std::vector<std::string> ClientArgv(const std::string& binary, const std::string& target,
                                    std::vector<std::string> ops);

// Polls `pred` until true or `timeout_ms` passes.
bool WaitFor(const std::function<bool()>& pred, int timeout_ms);

}  // namespace dos::testing
