#include "daemon/metrics/metrics_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "daemon/metrics/metrics_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A socket connected to the loopback port (receive deadline 5 s: no sleeps).
int Connect(uint16_t port, bool v6 = false) {
  int fd = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  int rc;
  if (v6) {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_port = htons(port);
    a.sin6_addr = in6addr_loopback;
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  EXPECT_EQ(rc, 0);
  return fd;
}

// Everything `fd` receives until the server closes it (or the deadline).
std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) out.append(buf, n);
  return out;
}

// Sends `request` to the loopback port and returns everything the server
// sent back before closing.
std::string Exchange(uint16_t port, const std::string& request, bool v6 = false) {
  const int fd = Connect(port, v6);
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out = ReadAll(fd);
  ::close(fd);
  return out;
}

class MetricsHttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    (*metrics_.AddCounter("dos_steps_total", "Steps."))->Add(3);
    auto s = MetricsHttpServer::Start({}, [this] { return metrics_.RenderText(); });
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    ASSERT_NE(server_->port(), 0);
  }
  MetricsRegistry metrics_;
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpServerTest, ServesMetrics) {
  std::string r = Exchange(server_->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
  const std::string body = metrics_.RenderText();
  EXPECT_THAT(r, HasSubstr("Content-Length: " + std::to_string(body.size()) + "\r\n"));
  EXPECT_THAT(r, HasSubstr("\r\n\r\n" + body));
  EXPECT_THAT(r, HasSubstr("dos_steps_total 3\n"));
}

TEST_F(MetricsHttpServerTest, ReflectsUpdatesBetweenScrapes) {
  Counter* c = *metrics_.AddCounter("dos_steps_total", "Steps.");
  c->Add(4);
  EXPECT_THAT(Exchange(server_->port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n"),
              HasSubstr("dos_steps_total 7\n"));
}

TEST_F(MetricsHttpServerTest, OtherPathsAre404) {
  EXPECT_THAT(Exchange(server_->port(), "GET / HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404 "));
  EXPECT_THAT(Exchange(server_->port(), "GET /metricsx HTTP/1.1\r\n\r\n"),
              StartsWith("HTTP/1.1 404 "));
}

TEST_F(MetricsHttpServerTest, OtherMethodsAre405) {
  std::string r = Exchange(server_->port(), "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 405 "));
  EXPECT_THAT(r, HasSubstr("Allow: GET\r\n"));
}

TEST_F(MetricsHttpServerTest, MalformedRequestIs400) {
  EXPECT_THAT(Exchange(server_->port(), "HELLO\r\n\r\n"), StartsWith("HTTP/1.1 400 "));
}

TEST_F(MetricsHttpServerTest, OversizedRequestIsRefused) {
  std::string r = Exchange(server_->port(),
                           "GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'a') + "\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 431 "));
}

TEST_F(MetricsHttpServerTest, SilentClientDoesNotBlockOthers) {
  // A client that connects and sends nothing is dropped at the read deadline;
  // a later scrape is answered meanwhile (connections are served together).
  const int idle = Connect(server_->port());
  EXPECT_THAT(Exchange(server_->port(), "GET /metrics HTTP/1.1\r\n\r\n"),
              StartsWith("HTTP/1.1 200 "));
  ::close(idle);
  EXPECT_GE(server_->requests(), 1u);
}

// With a read deadline far beyond the client's 5 s receive deadline, only
// serving connections side by side can answer the scrape: clients that
// connect and send nothing, or half a request, are held open meanwhile.
TEST(MetricsHttpServerSilentTest, SilentClientsNeverDelayAScrape) {
  MetricsHttpOptions o;
  o.read_timeout = absl::Seconds(600);
  auto s = MetricsHttpServer::Start(o, [] { return std::string("z 3\n"); });
  ASSERT_TRUE(s.ok()) << s.status();
  const uint16_t port = (*s)->port();
  std::vector<int> silent;
  for (int i = 0; i < 8; ++i) silent.push_back(Connect(port));
  const int half = Connect(port);
  ASSERT_EQ(::send(half, "GET /metr", 9, MSG_NOSIGNAL), 9);
  EXPECT_THAT(Exchange(port, "GET /metrics HTTP/1.1\r\n\r\n"), HasSubstr("\r\n\r\nz 3\n"));
  EXPECT_EQ((*s)->requests(), 1u);
  // The half request completes later and is answered too.
  const std::string rest = "ics HTTP/1.1\r\n\r\n";
  ASSERT_EQ(::send(half, rest.data(), rest.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(rest.size()));
  EXPECT_THAT(ReadAll(half), StartsWith("HTTP/1.1 200 "));
  ::close(half);
  for (int fd : silent) ::close(fd);
  s->reset();  // stops with silent clients it has not dropped yet
}

// A client that sends nothing gets nothing: closed at its read deadline.
TEST(MetricsHttpServerSilentTest, SilentClientIsClosedAtItsDeadline) {
  MetricsHttpOptions o;
  o.read_timeout = absl::Milliseconds(100);
  auto s = MetricsHttpServer::Start(o, [] { return std::string(); });
  ASSERT_TRUE(s.ok()) << s.status();
  const int idle = Connect((*s)->port());
  const absl::Time start = absl::Now();
  char b;
  EXPECT_EQ(::recv(idle, &b, 1, 0), 0) << "expected the server to close, not to time out";
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ::close(idle);
  EXPECT_EQ((*s)->requests(), 0u);
}

TEST(MetricsHttpServerBindTest, RefusesNonLoopbackUnlessAllowed) {
  MetricsHttpOptions o;
  o.host = "0.0.0.0";
  auto s = MetricsHttpServer::Start(o, [] { return std::string(); });
  EXPECT_EQ(s.status().code(), absl::StatusCode::kPermissionDenied) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("0.0.0.0"));
  o.host = "::";
  EXPECT_EQ(MetricsHttpServer::Start(o, [] { return std::string(); }).status().code(),
            absl::StatusCode::kPermissionDenied);
  o.host = "0.0.0.0";
  o.allow_non_loopback = true;
  auto allowed = MetricsHttpServer::Start(o, [] { return std::string("x 1\n"); });
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  EXPECT_THAT(Exchange((*allowed)->port(), "GET /metrics HTTP/1.1\r\n\r\n"),
              StartsWith("HTTP/1.1 200 "));
}

TEST(MetricsHttpServerBindTest, RefusesHostNames) {
  MetricsHttpOptions o;
  o.host = "example.com";
  EXPECT_EQ(MetricsHttpServer::Start(o, [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsHttpServerBindTest, LoopbackForms) {
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("127.3.2.1"));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_TRUE(IsLoopbackHost("::1"));
  EXPECT_TRUE(IsLoopbackHost("[::1]"));
  EXPECT_FALSE(IsLoopbackHost("10.0.0.1"));
  EXPECT_FALSE(IsLoopbackHost("::"));
  EXPECT_FALSE(IsLoopbackHost("128.0.0.1"));
}

TEST(MetricsHttpServerBindTest, ServesOnIpv6Loopback) {
  MetricsHttpOptions o;
  o.host = "::1";
  auto s = MetricsHttpServer::Start(o, [] { return std::string("y 2\n"); });
  if (!s.ok()) GTEST_SKIP() << "no IPv6 loopback here: " << s.status();
  EXPECT_THAT(Exchange((*s)->port(), "GET /metrics HTTP/1.1\r\n\r\n", true), HasSubstr("y 2\n"));
}

TEST(MetricsHttpServerBindTest, PortInUseIsUnavailable) {
  auto first = MetricsHttpServer::Start({}, [] { return std::string(); });
  ASSERT_TRUE(first.ok());
  MetricsHttpOptions o;
  o.port = (*first)->port();
  EXPECT_EQ(MetricsHttpServer::Start(o, [] { return std::string(); }).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace dos
