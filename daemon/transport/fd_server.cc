#include "daemon/transport/fd_server.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/log.h"

namespace dos {
namespace {

std::string NewTicket() {
  std::random_device rd;  // /dev/urandom
  std::string t;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&t, absl::StrFormat("%08x", rd()));
  return t;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DescriptorServer>> DescriptorServer::Start(const std::string& path,
                                                                           Options options,
                                                                           ResolveFn resolve) {
  ::unlink(path.c_str());  // a crashed dosd's; ours: the gRPC socket's lock is already held
  SocketListenerOptions o;
  o.type = SOCK_SEQPACKET;
  o.mode = options.socket_mode;
  o.group = options.group;
  o.backlog = 128;
  o.thread_name = "dos-fd";
  o.flag = "--socket (the descriptor socket is <socket>.fd)";
  absl::StatusOr<std::unique_ptr<SocketListener>> listener = SocketListener::Bind(path, std::move(o));
  if (!listener.ok()) return listener.status();
  std::unique_ptr<DescriptorServer> s(
      new DescriptorServer(path, std::move(options), std::move(resolve)));
  s->wake_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!s->wake_.valid()) {
    return absl::InternalError(absl::StrCat("eventfd for ", path, ": ", std::strerror(errno)));
  }
  s->io_thread_ = std::thread([raw = s.get()] {
    pthread_setname_np(pthread_self(), "dos-fd-io");
    raw->ServeLoop();
  });
  s->listener_ = *std::move(listener);
  if (absl::Status st =
          s->listener_->Serve([raw = s.get()](UniqueFd c) { raw->Accept(std::move(c)); });
      !st.ok()) {
    return st;
  }
  return s;
}

std::unique_ptr<DescriptorServer> DescriptorServer::ForTesting(Options options,
                                                               ResolveFn resolve) {
  return std::unique_ptr<DescriptorServer>(
      new DescriptorServer("", std::move(options), std::move(resolve)));
}

DescriptorServer::~DescriptorServer() {
  listener_.reset();  // no more Accept
  if (io_thread_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
    io_thread_.join();
  }
  // The state memory requests' threads refuse what is queued and end once
  // the one each serves is answered.
  absl::MutexLock lock(&mu_);
  stop_ = true;
  mu_.Await(absl::Condition(
      +[](int* threads) { return *threads == 0; }, &slow_threads_));
}

namespace {
// Answers `status` without waiting (the peer may not read) before the
// connection is closed. A request already there is read first: closing a
// unix socket with unread data makes the peer's next receive fail with
// ECONNRESET instead of reading the answer (the client retries once).
void Refuse(int fd, const absl::Status& status) {
  fdproto::Reply r = fdproto::MakeReply(status);
  (void)!::send(fd, &r, sizeof r, MSG_DONTWAIT | MSG_NOSIGNAL);
  alignas(fdproto::Request) char drain[sizeof(fdproto::Request)];
  while (::recv(fd, drain, sizeof drain, MSG_DONTWAIT) > 0) {
  }
}
}  // namespace

void DescriptorServer::Accept(UniqueFd conn) {
  const int fd = conn.get();
  // Replies are one small message into an empty socket buffer; never wait.
  timeval tv{0, 100'000};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  absl::StatusOr<std::shared_ptr<const PeerProcess>> caller = PeerProcess::FromSocket(fd);
  if (!caller.ok()) {
    Refuse(fd, caller.status());
    return;
  }
  LedgerCharge charge;
  if (options_.ledger != nullptr) {
    absl::StatusOr<LedgerCharge> c = options_.ledger->Charge(
        (*caller)->uid(), UidResource::kConnections, 1, "descriptor socket");
    if (!c.ok()) {
      Refuse(fd, c.status());
      return;
    }
    charge = *std::move(c);
  }
  {
    absl::MutexLock lock(&mu_);
    // Those whose state memory request waits for a thread count too.
    if (waiting_ + slow_requests_ >= options_.max_connections) {
      Refuse(fd, absl::ResourceExhaustedError(absl::StrCat(
                     "descriptor socket: ", waiting_ + slow_requests_,
                     " connections wait for their request or its answer; try again shortly "
                     "(dosd serves at most ",
                     options_.max_connections, ")")));
      return;
    }
    ++waiting_;
    incoming_.push_back(Waiting{std::move(conn), *std::move(caller), std::move(charge),
                                absl::Now() + options_.request_deadline});
  }
  uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void DescriptorServer::ServeLoop() {
  std::vector<Waiting> waiting;
  std::vector<pollfd> fds;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      for (Waiting& w : incoming_) waiting.push_back(std::move(w));
      incoming_.clear();
    }
    absl::Time next = absl::InfiniteFuture();
    fds.assign(1, pollfd{wake_.get(), POLLIN, 0});
    for (const Waiting& w : waiting) {
      fds.push_back(pollfd{w.conn.get(), POLLIN, 0});
      next = std::min(next, w.deadline);
    }
    // Rounded up, so that a wake-up is not a millisecond early.
    const int64_t left_ms = absl::ToInt64Milliseconds(next - absl::Now() + absl::Milliseconds(1));
    const int timeout_ms = next == absl::InfiniteFuture()
                               ? -1
                               : static_cast<int>(std::clamp<int64_t>(left_ms, 0, INT32_MAX));
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      DOS_LOG_ERROR("fd.poll_failed", "error", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (fds[0].revents != 0) {
      uint64_t n;
      (void)!::read(wake_.get(), &n, sizeof n);
    }
    const absl::Time now = absl::Now();
    std::vector<Waiting> still;
    size_t done = 0;
    for (size_t i = 0; i < waiting.size(); ++i) {
      if (fds[i + 1].revents != 0) {
        Serve(std::move(waiting[i]));
        ++done;
      } else if (waiting[i].deadline <= now) {
        Refuse(waiting[i].conn.get(),
               absl::DeadlineExceededError(absl::StrCat(
                   "descriptor socket: no request within ",
                   absl::FormatDuration(options_.request_deadline),
                   " of connecting; send the request as soon as you connect")));
        ++done;
      } else {
        still.push_back(std::move(waiting[i]));
      }
    }
    waiting.swap(still);
    absl::MutexLock lock(&mu_);
    waiting_ -= done;
  }
}

void DescriptorServer::Serve(Waiting w) {
  const int fd = w.conn.get();
  const std::shared_ptr<const PeerProcess>& caller = w.caller;
  alignas(fdproto::Request) char buf[sizeof(fdproto::Request) + 1];
  std::vector<UniqueFd> fds;
  absl::StatusOr<size_t> n = fdproto::ReceiveMessage(fd, buf, sizeof buf, &fds);
  if (!n.ok()) {
    DOS_LOG_WARNING("fd.bad_request", "pid", caller->pid(), "uid", caller->uid(), "error",
                    n.status().message());
    Refuse(fd, n.status());
    return;
  }
  // Short of descriptors: only uids that hold few sessions go on (checked
  // once the request is read: closing on an unread one resets the peer,
  // which would then not see why).
  if (options_.reserve != nullptr && options_.sessions_of) {
    const uint32_t uid = caller->uid();
    if (absl::Status st = options_.reserve->Admit(fd, uid, options_.sessions_of(uid)); !st.ok()) {
      Refuse(fd, st);
      return;
    }
  }
  std::string request(buf, *n);
  absl::StatusOr<fdproto::Request> req = fdproto::ParseRequest(buf, *n, fds.size());
  // Only a request for a session of the caller's waits for a thread (the
  // lookup is cheap; Handle answers any other).
  if (req.ok() && static_cast<fdproto::Op>(req->op) == fdproto::Op::kStateMemory &&
      resolve_(req->session_id, fdproto::RequestToken(*req), *caller).ok()) {
    Queue(Slow{std::move(w), std::move(request), std::move(fds)});
    return;
  }
  Answer(std::move(w), request, std::move(fds));
}

void DescriptorServer::Answer(Waiting w, const std::string& request, std::vector<UniqueFd> fds) {
  int send_fd = -1;
  SessionPort port;
  std::vector<UniqueFd> owned;
  fdproto::Reply reply =
      Handle(request.data(), request.size(), std::move(fds), w.caller, &send_fd, &port, &owned);
  std::vector<int> out;
  if (send_fd >= 0) out.push_back(send_fd);
  for (const UniqueFd& o : owned) out.push_back(o.get());
  absl::Status sent = fdproto::SendMessage(w.conn.get(), &reply, sizeof reply, out);
  // `port` is set only where a control block was sent.
  if (sent.ok() && port.hold_connection) port.hold_connection(std::move(w.conn));
}

void DescriptorServer::Queue(Slow slow) {
  const uint32_t uid = slow.w.caller->uid();
  absl::MutexLock lock(&mu_);
  // Each waits with its connection charged to its uid (kConnections); all
  // uids' together are bounded as the connections waiting for a request.
  if (stop_ || slow_requests_ >= options_.max_connections) {
    Refuse(slow.w.conn.get(),
           stop_ ? absl::UnavailableError("descriptor socket: dosd is stopping")
                 : absl::ResourceExhaustedError(
                       absl::StrCat("descriptor socket: ", slow_requests_,
                                    " state memory requests are being served; try again shortly")));
    return;
  }
  SlowQueue& q = slow_[uid];
  q.items.push_back(std::move(slow));
  ++slow_requests_;
  if (q.threads >= kSlowThreadsPerUid) return;  // one of its threads takes it
  try {
    std::thread([this, uid] { SlowWorker(uid); }).detach();
  } catch (const std::system_error& e) {
    if (q.threads > 0) return;  // a running one takes it later
    Refuse(q.items.back().w.conn.get(),
           absl::ResourceExhaustedError(
               absl::StrCat("descriptor socket: no thread for a state memory request (", e.what(),
                            "); try again shortly")));
    q.items.pop_back();
    --slow_requests_;
    if (q.items.empty()) slow_.erase(uid);
    return;
  }
  ++q.threads;
  ++slow_threads_;
}

void DescriptorServer::SlowWorker(uint32_t uid) {
  pthread_setname_np(pthread_self(), "dos-fd-state");
  while (true) {
    std::optional<Slow> next;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      SlowQueue& q = slow_[uid];
      if (q.items.empty()) {
        if (--q.threads == 0) slow_.erase(uid);
        --slow_threads_;  // the destructor may return once this is 0: touch nothing after
        return;
      }
      next.emplace(std::move(q.items.front()));
      q.items.pop_front();
      stopping = stop_;
    }
    // A client that gave up waiting (its call's timeout) is not served.
    pollfd gone{next->w.conn.get(), POLLRDHUP, 0};
    if (stopping) {
      Refuse(next->w.conn.get(), absl::UnavailableError("descriptor socket: dosd is stopping"));
    } else if (::poll(&gone, 1, 0) > 0 && (gone.revents & (POLLHUP | POLLRDHUP | POLLERR))) {
      DOS_LOG_INFO("fd.state_request_dropped", "uid", uid, "pid", next->w.caller->pid(), "reason",
                   "the client hung up while it waited");
    } else {
      Answer(std::move(next->w), next->request, std::move(next->fds));
    }
    next.reset();  // the connection closes and its charge goes before the count drops
    absl::MutexLock lock(&mu_);
    --slow_requests_;
  }
}

absl::StatusOr<std::string> DescriptorServer::IssueTicket(
    std::shared_ptr<const PeerProcess> caller) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  size_t of_uid = 0;
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    if (it->second.expires < now) {
      it = tickets_.erase(it);
      continue;
    }
    if (it->second.process->uid() == caller->uid()) ++of_uid;
    ++it;
  }
  if (tickets_.size() >= options_.max_tickets || of_uid >= options_.max_tickets_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "too many attaches in progress (", of_uid, " of uid ", caller->uid(), ", ",
        tickets_.size(), " in all); attach after the pending ones finish (tickets expire in ",
        absl::FormatDuration(options_.ticket_life), ")"));
  }
  std::string ticket = NewTicket();
  tickets_[ticket] = Ticket{std::move(caller), now + options_.ticket_life};
  return ticket;
}

absl::StatusOr<std::shared_ptr<const PeerProcess>> DescriptorServer::Redeem(
    absl::string_view ticket) {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(std::string(ticket));
  if (ticket.empty() || it == tickets_.end() || it->second.expires < absl::Now()) {
    if (it != tickets_.end()) tickets_.erase(it);
    return absl::PermissionDeniedError(absl::StrCat(
        "attach: fd_ticket is missing, unknown or expired; connect to dosd's descriptor socket ",
        path_.empty() ? "<socket>.fd" : path_,
        " first and pass the ticket it answers (libdos_client does this)"));
  }
  std::shared_ptr<const PeerProcess> p = std::move(it->second.process);
  tickets_.erase(it);
  return p;
}

fdproto::Reply DescriptorServer::Handle(const void* data, size_t n, std::vector<UniqueFd> fds,
                                        const std::shared_ptr<const PeerProcess>& caller,
                                        int* send_fd, SessionPort* port_out,
                                        std::vector<UniqueFd>* owned) {
  *send_fd = -1;
  absl::StatusOr<fdproto::Request> req = fdproto::ParseRequest(data, n, fds.size());
  if (!req.ok()) return fdproto::MakeReply(req.status());
  const auto op = static_cast<fdproto::Op>(req->op);
  if (op == fdproto::Op::kHello) {
    absl::StatusOr<std::string> ticket = IssueTicket(caller);
    if (!ticket.ok()) return fdproto::MakeReply(ticket.status());
    fdproto::Reply r = fdproto::MakeReply(absl::OkStatus());
    std::memcpy(r.text, ticket->data(), std::min(ticket->size(), sizeof(r.text) - 1));
    return r;
  }
  const std::string token = fdproto::RequestToken(*req);
  absl::StatusOr<SessionPort> port = resolve_(req->session_id, token, *caller);
  if (!port.ok()) {
    DOS_LOG_WARNING("fd.refused", "session", req->session_id, "pid", caller->pid(), "uid",
                    caller->uid(), "error", port.status().message());
    return fdproto::MakeReply(port.status());
  }
  if (op == fdproto::Op::kControlBlock) {
    if (port->control_block && owned != nullptr) {
      absl::StatusOr<UniqueFd> block = port->control_block();
      if (!block.ok()) return fdproto::MakeReply(block.status());
      owned->push_back(*std::move(block));
    } else {
      *send_fd = port->control_fd;
    }
    fdproto::Reply r = fdproto::MakeReply(absl::OkStatus());
    r.num_fds = 1;
    if (port_out != nullptr) *port_out = *port;
    return r;
  }
  if (op == fdproto::Op::kStateMemory) {
    if (!port->state_memory || owned == nullptr) {
      return fdproto::MakeReply(absl::UnimplementedError("state memory: not served here"));
    }
    absl::StatusOr<std::vector<UniqueFd>> mem = port->state_memory();
    if (!mem.ok()) return fdproto::MakeReply(mem.status());
    fdproto::Reply r = fdproto::MakeReply(absl::OkStatus());
    r.num_fds = static_cast<uint32_t>(mem->size());
    *owned = *std::move(mem);
    return r;
  }
  return ReceiveSegments(*req, std::move(fds), *caller, *port);
}

fdproto::Reply DescriptorServer::ReceiveSegments(const fdproto::Request& req,
                                                 std::vector<UniqueFd> fds,
                                                 const PeerProcess& caller,
                                                 const SessionPort& port) {
  const long page = ::sysconf(_SC_PAGESIZE);
  std::vector<std::unique_ptr<ShmSegment>> segments;
  for (size_t i = 0; i < fds.size(); ++i) {
    const std::string what = absl::StrCat("session ", req.session_id, " segment ", i);
    // Charged before it is mapped: a sparse memfd costs its sender nothing
    // but would cost dosd address space.
    // And one mapping of dosd's each (kSegments).
    absl::StatusOr<uint64_t> bytes = ShmSegment::SealedSize(fds[i].get(), what);
    absl::StatusOr<LedgerCharge> charge = LedgerCharge();
    absl::StatusOr<LedgerCharge> count = LedgerCharge();
    if (bytes.ok() && port.account != nullptr) {
      const uint64_t mapped = (*bytes + page - 1) / page * page;
      const std::string by = absl::StrCat("descriptor socket: ", what);
      count = port.account->Charge(UidResource::kSegments, 1, by);
      if (count.ok()) charge = port.account->Charge(UidResource::kMappedBytes, mapped, by);
    }
    absl::StatusOr<std::unique_ptr<ShmSegment>> seg =
        !bytes.ok()    ? bytes.status()
        : !count.ok()  ? count.status()
        : !charge.ok() ? charge.status()
                       : ShmSegment::Adopt(std::move(fds[i]), what);
    if (!seg.ok()) {
      DOS_LOG_WARNING("fd.segment_refused", "session", req.session_id, "pid", caller.pid(),
                      "uid", caller.uid(), "error", seg.status().message());
      return fdproto::MakeReply(seg.status());
    }
    auto held = std::make_shared<std::pair<LedgerCharge, LedgerCharge>>(*std::move(charge),
                                                                        *std::move(count));
    (*seg)->SetOnUnmap([held] {
      held->first.Reset();
      held->second.Reset();
    });
    segments.push_back(*std::move(seg));
  }
  absl::StatusOr<std::vector<uint64_t>> ids = port.inbox->AddAll(std::move(segments));
  if (!ids.ok()) return fdproto::MakeReply(ids.status());
  fdproto::Reply r = fdproto::MakeReply(absl::OkStatus());
  r.count = static_cast<uint32_t>(ids->size());
  for (size_t i = 0; i < ids->size(); ++i) r.segment_ids[i] = (*ids)[i];
  return r;
}

}  // namespace dos
