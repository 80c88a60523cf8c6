#include "daemon/transport/fd_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

using ::testing::HasSubstr;

UniqueFd IdleConnection(const std::string& path);

bool WaitFor(const std::function<bool()>& pred) {
  for (int i = 0; i < 500; ++i) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return pred();
}

// A descriptor server on a temporary socket with one fake session (id 7,
// token "secret", owned by this process's uid).
class FdServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/dos_fd_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/dosd.sock.fd";
    auto ctl = ShmSegment::Create("dos.ctl.test", 4096);
    ASSERT_TRUE(ctl.ok()) << ctl.status();
    control_ = *std::move(ctl);
    auto s = DescriptorServer::Start(
        path_, DescriptorServer::Options{},
        [this](uint64_t id, absl::string_view token,
               const PeerProcess& caller) -> absl::StatusOr<SessionPort> {
          if (id != 7) return absl::NotFoundError("no such session");
          if (token != "secret") return absl::PermissionDeniedError("wrong token");
          if (caller.uid() != owner_) return absl::PermissionDeniedError("not the owner");
          SessionPort p;
          p.control_fd = control_->fd();
          p.inbox = &inbox_;
          p.hold_connection = [this](UniqueFd c) { held_.push_back(std::move(c)); };
          absl::MutexLock lock(&hook_mu_);
          p.state_memory = state_memory_;
          return p;
        });
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  void TearDown() override {
    server_.reset();
    std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }

  std::string dir_, path_;
  uid_t owner_ = getuid();
  std::unique_ptr<ShmSegment> control_;
  SegmentInbox inbox_;
  std::vector<UniqueFd> held_;  // touched by the server thread only while a test waits on it
  // Serves kStateMemory when set (SetStateMemory).
  absl::Mutex hook_mu_;
  std::function<absl::StatusOr<std::vector<UniqueFd>>()> state_memory_ ABSL_GUARDED_BY(hook_mu_);
  void SetStateMemory(std::function<absl::StatusOr<std::vector<UniqueFd>>()> f) {
    absl::MutexLock lock(&hook_mu_);
    state_memory_ = std::move(f);
  }
  // kStateMemory counts each call in entered_ and waits for release_ (at
  // most 20 s), then answers `answer()`.
  absl::Notification release_;
  std::atomic<int> entered_{0};
  void BlockStateMemory(std::function<absl::StatusOr<std::vector<UniqueFd>>()> answer) {
    SetStateMemory([this, answer = std::move(answer)] {
      entered_.fetch_add(1);
      release_.WaitForNotificationWithTimeout(absl::Seconds(20));
      return answer();
    });
  }
  // Every thread one uid may have serves a blocked state memory request.
  bool SlowThreadsAllBlocked() {
    return WaitFor([&] { return entered_.load() == DescriptorServer::kSlowThreadsPerUid; });
  }
  std::unique_ptr<DescriptorServer> server_;
};

TEST_F(FdServerTest, HelloTicketRedeemsOnceToTheCallersKernelIdentity) {
  auto ticket = fdproto::Hello(path_);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(ticket->size(), 32u);
  auto p = server_->Redeem(*ticket);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->pid(), getpid());
  EXPECT_EQ((*p)->uid(), getuid());
  EXPECT_TRUE((*p)->Alive());
  EXPECT_EQ(server_->Redeem(*ticket).status().code(), absl::StatusCode::kPermissionDenied);
  auto none = server_->Redeem("");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(none.status().message(), HasSubstr(path_));
  EXPECT_EQ(server_->Redeem("0123456789abcdef0123456789abcdef").status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(FdServerTest, PidfdSeesAChildExitEvenAsAZombie) {
  pid_t child = fork();
  if (child == 0) {
    char c;
    (void)!read(0, &c, 0);
    _exit(0);
  }
  auto p = PeerProcess::FromPid(child);
  ASSERT_TRUE(p.ok()) << p.status();
  // Not reaped yet: a zombie is not alive.
  for (int i = 0; i < 500 && (*p)->Alive(); ++i) {
    pollfd none{};
    poll(&none, 0, 10);  // bounded wait for the exit (5 s)
  }
  EXPECT_FALSE((*p)->Alive());
  int status;
  waitpid(child, &status, 0);
  EXPECT_FALSE((*p)->Alive());
}

TEST_F(FdServerTest, ControlBlockGoesToTheOwnerWithTheTokenAndTheConnectionIsHeld) {
  auto cb = fdproto::FetchControlBlock(path_, 7, "secret");
  ASSERT_TRUE(cb.ok()) << cb.status();
  auto seg = ShmSegment::Adopt(std::move(cb->memfd), "control block");
  ASSERT_TRUE(seg.ok()) << seg.status();
  static_cast<char*>(control_->data())[10] = 9;
  EXPECT_EQ(static_cast<char*>((*seg)->data())[10], 9);
  // dosd keeps its end: our end does not read as hung up.
  pollfd p{cb->connection.get(), POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 0), 0);
  EXPECT_EQ(fdproto::FetchControlBlock(path_, 7, "wrong").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(fdproto::FetchControlBlock(path_, 8, "secret").status().code(),
            absl::StatusCode::kNotFound);
  owner_ = getuid() + 1;  // the session belongs to someone else now
  EXPECT_EQ(fdproto::FetchControlBlock(path_, 7, "secret").status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(FdServerTest, SealedSegmentsAreFiledUnsealedOnesRefused) {
  auto a = ShmSegment::Create("dos.a", 4096);
  auto b = ShmSegment::Create("dos.b", 8192);
  ASSERT_TRUE(a.ok() && b.ok());
  const int fds[] = {(*a)->fd(), (*b)->fd()};
  auto ids = fdproto::SendSegments(path_, 7, "secret", fds);
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_EQ(ids->size(), 2u);
  EXPECT_EQ(inbox_.pending(), 2u);
  auto sb = inbox_.Take((*ids)[1], "b");
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ((*sb)->size(), 8192u);
  EXPECT_EQ(inbox_.Take((*ids)[1], "b again").status().code(), absl::StatusCode::kNotFound);

  UniqueFd raw(memfd_create("dos.raw", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(ftruncate(raw.get(), 4096), 0);
  const int r = raw.get();
  auto refused = fdproto::SendSegments(path_, 7, "secret", {&r, 1});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("F_SEAL_SHRINK"));
  // All or nothing: a good one next to a bad one is not filed either.
  const int mixed[] = {(*a)->fd(), r};
  EXPECT_FALSE(fdproto::SendSegments(path_, 7, "secret", mixed).ok());
  EXPECT_EQ(inbox_.pending(), 1u);
  EXPECT_EQ(fdproto::SendSegments(path_, 7, "wrong", {fds, 1}).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(FdServerTest, MalformedRequestsGetAnError) {
  fdproto::Request req = fdproto::MakeRequest(fdproto::Op::kSegments, 7, "secret", 3);
  auto ex = fdproto::Call(path_, req, {});  // announces 3, carries 0
  EXPECT_EQ(ex.status().code(), absl::StatusCode::kInvalidArgument);
  req = fdproto::MakeRequest(fdproto::Op::kHello, 0, "", 0);
  req.version = 99;
  EXPECT_EQ(fdproto::Call(path_, req, {}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  req = fdproto::MakeRequest(static_cast<fdproto::Op>(9), 7, "secret", 0);
  EXPECT_EQ(fdproto::Call(path_, req, {}).status().code(), absl::StatusCode::kInvalidArgument);
  // The server still answers.
  EXPECT_TRUE(fdproto::Hello(path_).ok());
}

TEST_F(FdServerTest, OutstandingTicketsPerUidAreCapped) {
  std::vector<std::string> tickets;
  absl::Status last;
  for (int i = 0; i < 70; ++i) {
    auto t = fdproto::Hello(path_);
    if (!t.ok()) {
      last = t.status();
      break;
    }
    tickets.push_back(*t);
  }
  EXPECT_EQ(tickets.size(), 64u);
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(server_->Redeem(tickets[0]).ok());
  EXPECT_TRUE(fdproto::Hello(path_).ok());  // one slot free again
}

// A state memory request may wait for its session's step (up to 11 s for a
// trainer that stalls); it once held the serving thread, and every other
// user's attach, meanwhile. Now it waits on its uid's own thread.
TEST_F(FdServerTest, AStateMemoryRequestThatWaitsHoldsUpNoOtherRequest) {
  BlockStateMemory([]() -> absl::StatusOr<std::vector<UniqueFd>> {
    std::vector<UniqueFd> fds;
    for (const char* name : {"dos.state", "dos.map"}) {
      fds.emplace_back(memfd_create(name, MFD_CLOEXEC));
    }
    return fds;
  });
  // Three waiting calls of one uid: two are served at once, the third queues.
  std::vector<std::thread> readers;
  std::atomic<int> ok{0};
  for (int i = 0; i < 3; ++i) {
    readers.emplace_back([&] {
      if (fdproto::FetchStateMemory(path_, 7, "secret").ok()) ok.fetch_add(1);
    });
  }
  ASSERT_TRUE(SlowThreadsAllBlocked());
  const absl::Time t0 = absl::Now();
  EXPECT_TRUE(fdproto::Hello(path_).ok());
  EXPECT_TRUE(fdproto::FetchControlBlock(path_, 7, "secret").ok());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(entered_.load(), DescriptorServer::kSlowThreadsPerUid);
  release_.Notify();
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(ok.load(), 3);
  EXPECT_EQ(entered_.load(), 3);
}

// A queued state memory request whose client hung up (its call timed out)
// is dropped, not served: it holds its uid's connection charge no longer.
TEST_F(FdServerTest, AQueuedStateMemoryRequestWhoseClientHungUpIsDropped) {
  BlockStateMemory([]() -> absl::StatusOr<std::vector<UniqueFd>> {
    return absl::AbortedError("state memory: busy");
  });
  std::vector<std::thread> readers;
  for (int i = 0; i < DescriptorServer::kSlowThreadsPerUid; ++i) {
    readers.emplace_back([&] { (void)fdproto::FetchStateMemory(path_, 7, "secret"); });
  }
  ASSERT_TRUE(SlowThreadsAllBlocked());
  {
    UniqueFd gone = IdleConnection(path_);
    const fdproto::Request req = fdproto::MakeRequest(fdproto::Op::kStateMemory, 7, "secret", 0);
    ASSERT_TRUE(fdproto::SendMessage(gone.get(), &req, sizeof req, {}).ok());
    absl::SleepFor(absl::Milliseconds(100));  // queued behind the two
  }                                           // hung up
  release_.Notify();
  for (std::thread& t : readers) t.join();
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(entered_.load(), DescriptorServer::kSlowThreadsPerUid);
  EXPECT_TRUE(fdproto::Hello(path_).ok());
}

// A server stopped while a state memory request waits answers it, refuses
// the queued ones, and stops.
TEST_F(FdServerTest, StoppingWithStateMemoryRequestsWaitingAnswersThemAll) {
  BlockStateMemory([]() -> absl::StatusOr<std::vector<UniqueFd>> {
    return absl::AbortedError("state memory: the session's step holds it");
  });
  std::vector<std::thread> readers;
  std::atomic<int> answered{0};
  for (int i = 0; i < 4; ++i) {
    readers.emplace_back([&] {
      absl::Status st = fdproto::FetchStateMemory(path_, 7, "secret").status();
      if (st.code() == absl::StatusCode::kAborted || st.code() == absl::StatusCode::kUnavailable) {
        answered.fetch_add(1);
      }
    });
  }
  ASSERT_TRUE(SlowThreadsAllBlocked());
  absl::SleepFor(absl::Milliseconds(100));  // the other two queue
  std::thread stop([&] { server_.reset(); });
  absl::SleepFor(absl::Milliseconds(100));
  release_.Notify();
  stop.join();
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(answered.load(), 4);
  EXPECT_EQ(entered_.load(), DescriptorServer::kSlowThreadsPerUid);
}

// A connection to `path` that sends nothing.
UniqueFd IdleConnection(const std::string& path) {
  UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  return s;
}

TEST_F(FdServerTest, IdleConnectionsDelayNoOneAndAreClosedAtTheirDeadline) {
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 8; ++i) idle.push_back(IdleConnection(path_));
  const absl::Time start = absl::Now();
  EXPECT_TRUE(fdproto::Hello(path_, absl::Seconds(5)).ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  // Answered DEADLINE_EXCEEDED and closed about 2 s after connecting.
  pollfd p{idle[0].get(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  fdproto::Reply r{};
  ASSERT_EQ(::recv(idle[0].get(), &r, sizeof r, 0), static_cast<ssize_t>(sizeof r));
  EXPECT_EQ(r.status_code, static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(fdproto::ReplyText(r), HasSubstr("no request within"));
}

TEST(FdServerLimitsTest, ConnectionsPerUidAreBoundedAndTheClientHonoursItsTimeout) {
  char dir[] = "/tmp/dos_fd_test.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/dosd.sock.fd";
  UidLimits limits;
  limits.per_uid[static_cast<size_t>(UidResource::kConnections)] = 2;
  UidLedger ledger(limits);
  DescriptorServer::Options o;
  o.ledger = &ledger;
  o.request_deadline = absl::Milliseconds(300);
  auto server = DescriptorServer::Start(
      path, o, [](uint64_t, absl::string_view, const PeerProcess&) -> absl::StatusOr<SessionPort> {
        return absl::NotFoundError("none");
      });
  ASSERT_TRUE(server.ok()) << server.status();
  UniqueFd a = IdleConnection(path), b = IdleConnection(path);
  ASSERT_TRUE(WaitFor([&] {  // both accepted and charged
    return ledger.Snapshot()[getuid()].used[static_cast<size_t>(UidResource::kConnections)] == 2;
  }));
  absl::StatusOr<std::string> refused = fdproto::Hello(path, absl::Seconds(5));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("--max_fd_connections_per_uid=2"));
  // Their deadline frees the uid's share.
  EXPECT_TRUE(WaitFor([&] { return fdproto::Hello(path, absl::Seconds(5)).ok(); }));
  server->reset();
  // Nothing accepts (a listening socket nobody serves: the backlog fills);
  // the client gives up at its timeout instead of waiting for ever.
  UniqueFd l(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  ASSERT_EQ(::bind(l.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(l.get(), 0), 0);
  std::vector<UniqueFd> queued;
  for (int i = 0; i < 4; ++i) {
    UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    ::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    queued.push_back(std::move(s));
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> late = fdproto::Hello(path, absl::Milliseconds(300));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  std::system(absl::StrCat("rm -rf ", dir).c_str());
}

TEST(FdProtocolTest, ParseRejectsEverythingButWellFormedRequests) {
  fdproto::Request r = fdproto::MakeRequest(fdproto::Op::kControlBlock, 1, "t", 0);
  EXPECT_TRUE(fdproto::ParseRequest(&r, sizeof r, 0).ok());
  EXPECT_FALSE(fdproto::ParseRequest(&r, sizeof r - 1, 0).ok());
  EXPECT_FALSE(fdproto::ParseRequest(&r, sizeof r, 1).ok());
  r.session_id = 0;
  EXPECT_FALSE(fdproto::ParseRequest(&r, sizeof r, 0).ok());
  r = fdproto::MakeRequest(fdproto::Op::kSegments, 1, "t", fdproto::kMaxFds + 1);
  EXPECT_FALSE(fdproto::ParseRequest(&r, sizeof r, fdproto::kMaxFds + 1).ok());
  r.magic = 0;
  EXPECT_FALSE(fdproto::ParseRequest(&r, sizeof r, 0).ok());
  fdproto::Reply rep = fdproto::MakeReply(absl::OkStatus());
  rep.count = fdproto::kMaxFds + 1;
  EXPECT_FALSE(fdproto::ParseReply(&rep, sizeof rep, 0).ok());
}

}  // namespace
}  // namespace dos
