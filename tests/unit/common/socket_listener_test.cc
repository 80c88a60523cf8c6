// SocketListener: the one accept loop of dosd's sockets (the gRPC and the
// descriptor socket, and the metrics endpoint over TCP): permissions before
// anyone connects, handler on the listener's thread, orderly stop, the socket
// file removed.
#include "daemon/common/socket_listener.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

class SocketListenerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/dos_listener_test.XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/s.sock";
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  // Connects to path_; the connected descriptor or -1.
  int Connect(int type = SOCK_STREAM) {
    int fd = ::socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path_.c_str());
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd);
      return -1;
    }
    return fd;
  }

  std::string dir_, path_;
};

TEST_F(SocketListenerTest, ServesEachConnectionAndRemovesTheSocketWhenDestroyed) {
  SocketListenerOptions o;
  o.type = SOCK_SEQPACKET;
  o.mode = 0640;
  o.thread_name = "test-listen";
  auto l = SocketListener::Bind(path_, o);
  ASSERT_TRUE(l.ok()) << l.status();
  struct stat st;
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  // Bound but not listening: a connect is refused, not queued.
  EXPECT_EQ(Connect(SOCK_SEQPACKET), -1);

  absl::Mutex mu;
  int served = 0;
  ASSERT_TRUE((*l)->Serve([&](UniqueFd c) {
                   char b = 0;
                   ASSERT_EQ(::read(c.get(), &b, 1), 1);
                   ASSERT_EQ(::write(c.get(), &b, 1), 1);
                   absl::MutexLock lock(&mu);
                   ++served;
                 })
                  .ok());
  EXPECT_FALSE((*l)->Serve([](UniqueFd) {}).ok()) << "served twice";
  for (char i = 0; i < 3; ++i) {
    int fd = Connect(SOCK_SEQPACKET);
    ASSERT_GE(fd, 0);
    char b = i;
    ASSERT_EQ(::write(fd, &b, 1), 1);
    char back = -1;
    ASSERT_EQ(::read(fd, &back, 1), 1);
    EXPECT_EQ(back, i);
    ::close(fd);
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(+[](int* n) { return *n == 3; }, &served));
  }
  (*l)->Stop();
  (*l)->Stop();  // idempotent
  l->reset();
  EXPECT_NE(::access(path_.c_str(), F_OK), 0) << "socket file left behind";
}

TEST_F(SocketListenerTest, StopsWithoutEverServingAndWhileIdle) {
  auto idle = SocketListener::Bind(path_, {});
  ASSERT_TRUE(idle.ok()) << idle.status();
  idle->reset();  // never served
  EXPECT_NE(::access(path_.c_str(), F_OK), 0);
  auto l = SocketListener::Bind(path_, {});
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_TRUE((*l)->Serve([](UniqueFd) {}).ok());
  l->reset();  // wakes the poll and joins
  EXPECT_NE(::access(path_.c_str(), F_OK), 0);
}

TEST_F(SocketListenerTest, ErrorsNameThePathAndTheFix) {
  SocketListenerOptions o;
  o.flag = "--socket";
  auto too_long = SocketListener::Bind(dir_ + "/" + std::string(200, 'x'), o);
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("use a shorter --socket"), std::string::npos)
      << too_long.status();
  auto missing = SocketListener::Bind(dir_ + "/no/such/dir/s.sock", o);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(missing.status().message().find(dir_ + "/no/such/dir/s.sock"), std::string::npos)
      << missing.status();
  // A file already there (another daemon's socket) is not replaced.
  auto first = SocketListener::Bind(path_, o);
  ASSERT_TRUE(first.ok());
  auto second = SocketListener::Bind(path_, o);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_EQ(::access(path_.c_str(), F_OK), 0) << "the first listener's socket was removed";
}


// Connects to 127.0.0.1:port; the connected descriptor or -1.
int ConnectTcp(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

TEST(SocketListenerTcpTest, ServesLoopbackOnAnyFreePortAndReportsAPortInUse) {
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  SocketListenerOptions o;
  o.thread_name = "test-tcp";
  o.flag = "--test_port";
  auto l = SocketListener::BindTcp(reinterpret_cast<sockaddr*>(&any), sizeof any, o);
  ASSERT_TRUE(l.ok()) << l.status();
  const uint16_t port = (*l)->port();
  ASSERT_NE(port, 0);
  EXPECT_EQ((*l)->path(), "");
  // Bound but not listening: refused, as for a unix socket.
  EXPECT_EQ(ConnectTcp(port), -1);
  absl::Mutex mu;
  int served = 0;
  ASSERT_TRUE((*l)->Serve([&](UniqueFd c) {
                   ASSERT_EQ(::write(c.get(), "k", 1), 1);
                   absl::MutexLock lock(&mu);
                   ++served;
                 })
                  .ok());
  const int fd = ConnectTcp(port);
  ASSERT_GE(fd, 0);
  char b = 0;
  EXPECT_EQ(::read(fd, &b, 1), 1);
  EXPECT_EQ(b, 'k');
  ::close(fd);
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(+[](int* n) { return *n == 1; }, &served));
  }
  sockaddr_in same = any;
  same.sin_port = htons(port);
  auto again = SocketListener::BindTcp(reinterpret_cast<sockaddr*>(&same), sizeof same, o);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  EXPECT_NE(again.status().message().find("tcp:127.0.0.1:" + std::to_string(port)),
            std::string::npos) << again.status();
  EXPECT_NE(again.status().message().find("--test_port"), std::string::npos) << again.status();
  l->reset();
  EXPECT_EQ(ConnectTcp(port), -1) << "still accepting after destruction";
}

}  // namespace
}  // namespace dos
