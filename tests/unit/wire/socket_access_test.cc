// CheckDaemonSocket: a missing socket, something else at the path, and a
// folder or socket that refuses the user, each named with its fix. The
// refusals are seen from a forked child that drops root to `nobody` (root
// passes every permission check), so those tests need root, as CI has.
#include "dos/wire/socket_access.h"

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

class SocketAccessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dos-socket-access-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);
  }
  void TearDown() override {
    if (fd_ >= 0) ::close(fd_);
    std::filesystem::remove_all(dir_);
  }

  // A listening unix socket at `path` with `mode`.
  void Listen(const std::string& path, mode_t mode) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd_, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(::listen(fd_, 4), 0);
    ASSERT_EQ(::chmod(path.c_str(), mode), 0);
  }

  std::string dir_;
  int fd_ = -1;
};

// What CheckDaemonSocket(path) says in a child running as uid `uid`, gid
// `gid` and no supplementary groups: "<code> <message>".
std::string CheckAs(uid_t uid, gid_t gid, const std::string& path) {
  int p[2];
  if (::pipe(p) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p[0]);
    if (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) ::_exit(3);
    const absl::Status st = CheckDaemonSocket(path);
    const std::string out =
        std::to_string(static_cast<int>(st.code())) + " " + std::string(st.message());
    (void)!::write(p[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(p[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(p[0], buf, sizeof(buf))) > 0;) out.append(buf, n);
  ::close(p[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return out;
}

std::string Code(absl::StatusCode c) { return std::to_string(static_cast<int>(c)) + " "; }

TEST_F(SocketAccessTest, NothingThereIsNoDaemonAndSaysHowToStartOne) {
  const std::string path = dir_ + "/none/dosd.sock";
  absl::Status st = CheckDaemonSocket(path);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(st.message(), AllOf(HasSubstr("no dosd socket at " + path),
                                  HasSubstr("start the daemon"), HasSubstr("DOS_SOCKET")));
}

TEST_F(SocketAccessTest, AFileIsNotASocket) {
  const std::string path = dir_ + "/dosd.sock";
  std::ofstream(path) << "x";
  absl::Status st = CheckDaemonSocket(path);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr(path + " is not a socket"));
}

TEST_F(SocketAccessTest, AListeningSocketIsReachable) {
  Listen(dir_ + "/dosd.sock", 0660);
  EXPECT_TRUE(CheckDaemonSocket(dir_ + "/dosd.sock").ok());
  ASSERT_EQ(::chdir(dir_.c_str()), 0);
  EXPECT_TRUE(CheckDaemonSocket("dosd.sock").ok());  // relative paths too
  ASSERT_EQ(::chdir("/"), 0);
}

class SocketAccessAsOtherUserTest : public SocketAccessTest {
 protected:
  void SetUp() override {
    SocketAccessTest::SetUp();
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as a user outside the group";
    const passwd* pw = ::getpwnam("nobody");
    if (pw == nullptr) GTEST_SKIP() << "no user nobody";
    nobody_ = pw->pw_uid;
    nobody_gid_ = pw->pw_gid;
    // A group nobody is not in (root's), like dos for a user not yet added.
    other_gid_ = 0;
    ASSERT_NE(nobody_gid_, other_gid_);
    run_ = dir_ + "/run";
    ASSERT_EQ(::mkdir(run_.c_str(), 0750), 0);
    ASSERT_EQ(::chmod(run_.c_str(), 0750), 0);
    Listen(run_ + "/dosd.sock", 0660);
  }
  std::string Group(gid_t gid) { return ::getgrgid(gid)->gr_name; }

  uid_t nobody_ = 0;
  gid_t nobody_gid_ = 0, other_gid_ = 0;
  std::string run_;
};

TEST_F(SocketAccessAsOtherUserTest, UserNotInTheGroupIsToldToJoinItAndLogInAgain) {
  // /run/dos as packaged: mode 0750, a group the user is not in.
  ASSERT_EQ(::chown(run_.c_str(), 0, other_gid_), 0);
  const std::string out = CheckAs(nobody_, nobody_gid_, run_ + "/dosd.sock");
  const std::string g = Group(other_gid_);
  EXPECT_THAT(out, AllOf(HasSubstr(Code(absl::StatusCode::kPermissionDenied)),
                         HasSubstr("the folder " + run_ + " (mode 0750, group " + g + ")"),
                         HasSubstr("nobody is not in group " + g),
                         HasSubstr("sudo usermod -aG " + g + " nobody"),
                         HasSubstr("log in again"), Not(HasSubstr("no dosd socket"))));
}

TEST_F(SocketAccessAsOtherUserTest, UserAddedAfterLoggingInIsToldToLogInAgain) {
  // The account's group (nobody's primary, per the database) that this
  // process does not carry: a login that began before `usermod -aG`.
  ASSERT_EQ(::chown(run_.c_str(), 0, nobody_gid_), 0);
  const std::string out = CheckAs(nobody_, other_gid_, run_ + "/dosd.sock");
  const std::string g = Group(nobody_gid_);
  EXPECT_THAT(out, AllOf(HasSubstr(Code(absl::StatusCode::kPermissionDenied)),
                         HasSubstr("nobody is in group " + g + " but this login is not"),
                         HasSubstr("log in again"), HasSubstr("newgrp " + g),
                         Not(HasSubstr("usermod"))));
}

TEST_F(SocketAccessAsOtherUserTest, SocketThatRefusesTheUserIsNamed) {
  // The folder lets everyone in; the socket (0660, root's group) does not.
  ASSERT_EQ(::chmod(run_.c_str(), 0755), 0);
  const std::string sock = run_ + "/dosd.sock";
  const std::string out = CheckAs(nobody_, nobody_gid_, sock);
  EXPECT_THAT(out, AllOf(HasSubstr(Code(absl::StatusCode::kPermissionDenied)),
                         HasSubstr("the socket " + sock + " (mode 0660, group " +
                                   Group(other_gid_) + ")"),
                         HasSubstr("log in again")));
  // In the group: reachable.
  ASSERT_EQ(::chown(sock.c_str(), 0, nobody_gid_), 0);
  EXPECT_EQ(CheckAs(nobody_, nobody_gid_, sock), Code(absl::StatusCode::kOk));
}

}  // namespace
}  // namespace dos
