#include "daemon/common/sd_notify.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace dos {
namespace {

// A datagram socket standing in for systemd's notify socket.
class FakeNotifySocket {
 public:
  explicit FakeNotifySocket(bool abstract) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (abstract) {
      name_ = "@dos-sd-notify-test-" + std::to_string(::getpid());
    } else {
      name_ = "/tmp/dos-sd-notify-test-" + std::to_string(::getpid());
      ::unlink(name_.c_str());
    }
    ::memcpy(addr.sun_path, name_.data(), name_.size());
    if (abstract) addr.sun_path[0] = '\0';
    socklen_t len = offsetof(sockaddr_un, sun_path) + name_.size();
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0);
    timeval tv{5, 0};  // a deadline, never a sleep
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setenv("NOTIFY_SOCKET", name_.c_str(), 1);
  }
  ~FakeNotifySocket() {
    ::unsetenv("NOTIFY_SOCKET");
    ::close(fd_);
    if (name_[0] == '/') ::unlink(name_.c_str());
  }
  std::string Receive() {
    char buf[256];
    ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    return n < 0 ? std::string("<timeout>") : std::string(buf, n);
  }

 private:
  int fd_;
  std::string name_;
};

TEST(SdNotifyTest, NoSocketIsANoOp) {
  ::unsetenv("NOTIFY_SOCKET");
  EXPECT_TRUE(SdNotify("READY=1").ok());
}

TEST(SdNotifyTest, SendsToAPathSocket) {
  FakeNotifySocket sock(false);
  ASSERT_TRUE(SdNotify("READY=1\nSTATUS=serving").ok());
  EXPECT_EQ(sock.Receive(), "READY=1\nSTATUS=serving");
}

TEST(SdNotifyTest, SendsToAnAbstractSocket) {
  FakeNotifySocket sock(true);
  ASSERT_TRUE(SdNotify("STOPPING=1").ok());
  EXPECT_EQ(sock.Receive(), "STOPPING=1");
}

TEST(SdNotifyTest, RelativeSocketIsRefused) {
  ::setenv("NOTIFY_SOCKET", "relative", 1);
  EXPECT_EQ(SdNotify("READY=1").code(), absl::StatusCode::kInvalidArgument);
  ::unsetenv("NOTIFY_SOCKET");
}

TEST(SdWatchdogTest, DisabledWithoutWatchdogUsec) {
  ::unsetenv("WATCHDOG_USEC");
  SdWatchdog w([] { return true; });
  EXPECT_FALSE(w.enabled());
}

TEST(SdWatchdogTest, IgnoresAnotherProcessesWatchdog) {
  ::setenv("WATCHDOG_USEC", "100000", 1);
  ::setenv("WATCHDOG_PID", "1", 1);
  EXPECT_FALSE(SdWatchdogInterval().has_value());
  ::unsetenv("WATCHDOG_PID");
  ASSERT_TRUE(SdWatchdogInterval().has_value());
  EXPECT_EQ(*SdWatchdogInterval(), absl::Milliseconds(100));
  ::unsetenv("WATCHDOG_USEC");
}

TEST(SdWatchdogTest, PingsWhileHealthy) {
  FakeNotifySocket sock(false);
  ::setenv("WATCHDOG_USEC", "20000", 1);
  {
    SdWatchdog w([] { return true; });
    EXPECT_TRUE(w.enabled());
    EXPECT_EQ(sock.Receive(), "WATCHDOG=1");
    EXPECT_EQ(sock.Receive(), "WATCHDOG=1");
  }
  ::unsetenv("WATCHDOG_USEC");
}

}  // namespace
}  // namespace dos
