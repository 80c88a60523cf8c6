#include "dos/wire/fd_protocol.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace dos::fdproto {
namespace {

template <typename T>
absl::StatusOr<T> Header(const void* data, size_t n, absl::string_view what) {
  if (n != sizeof(T)) {
    return absl::InvalidArgumentError(absl::StrCat("descriptor socket: ", what, " of ", n,
                                                   " bytes; expected ", sizeof(T)));
  }
  T t;
  std::memcpy(&t, data, sizeof t);
  if (t.magic != kMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor socket: ", what, " has a bad magic; not a dos peer"));
  }
  if (t.version != kVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("descriptor socket: ", what, " version ", t.version, ", this side speaks ",
                     kVersion, "; use a client library and dosd of the same release"));
  }
  return t;
}

void CopyBounded(char* dst, size_t cap, absl::string_view src) {
  const size_t n = std::min(src.size(), cap - 1);
  // An empty string_view may carry a null data(): memcpy's arguments must not be null.
  if (n > 0) std::memcpy(dst, src.data(), n);
  std::memset(dst + n, 0, cap - n);
}

}  // namespace

std::string SocketPathFor(const std::string& grpc_socket) { return grpc_socket + ".fd"; }

Request MakeRequest(Op op, uint64_t session_id, absl::string_view token, uint32_t num_fds) {
  Request r;
  std::memset(&r, 0, sizeof r);
  r.magic = kMagic;
  r.version = kVersion;
  r.op = static_cast<uint32_t>(op);
  r.num_fds = num_fds;
  r.session_id = session_id;
  CopyBounded(r.token, sizeof r.token, token);
  return r;
}

Reply MakeReply(const absl::Status& status) {
  Reply r;
  std::memset(&r, 0, sizeof r);
  r.magic = kMagic;
  r.version = kVersion;
  r.status_code = static_cast<int32_t>(status.code());
  CopyBounded(r.text, sizeof r.text, status.message());
  return r;
}

std::string ReplyText(const Reply& reply) {
  return std::string(reply.text, strnlen(reply.text, sizeof reply.text));
}

std::string RequestToken(const Request& request) {
  return std::string(request.token, strnlen(request.token, sizeof request.token));
}

absl::StatusOr<Request> ParseRequest(const void* data, size_t n, size_t fds_received) {
  absl::StatusOr<Request> r = Header<Request>(data, n, "request");
  if (!r.ok()) return r.status();
  const Op op = static_cast<Op>(r->op);
  if (op != Op::kHello && op != Op::kControlBlock && op != Op::kSegments &&
      op != Op::kStateMemory) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor socket: unknown request op ", r->op,
                     "; expected 1 to 4 (hello, control block, segments, state memory): "
                     "client and dosd may be of different versions"));
  }
  if (r->num_fds != fds_received) {
    return absl::InvalidArgumentError(absl::StrCat("descriptor socket: request announces ",
                                                   r->num_fds, " descriptors but carries ",
                                                   fds_received));
  }
  if (op == Op::kSegments ? (r->num_fds == 0 || r->num_fds > kMaxFds) : r->num_fds != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor socket: op ", r->op, " with ", r->num_fds,
        " descriptors; only a segments request carries them, 1 to ", kMaxFds));
  }
  if (op != Op::kHello && (r->session_id == 0 || r->token[0] == '\0')) {
    return absl::InvalidArgumentError(
        "descriptor socket: request names no session; pass the id and token Attach returned");
  }
  return r;
}

absl::StatusOr<Reply> ParseReply(const void* data, size_t n, size_t fds_received) {
  absl::StatusOr<Reply> r = Header<Reply>(data, n, "reply");
  if (!r.ok()) return r.status();
  if (r->num_fds != fds_received || r->num_fds > 2 || r->count > kMaxFds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor socket: malformed reply (", r->num_fds, " descriptors announced, ",
        fds_received, " received, ", r->count, " ids)"));
  }
  return r;
}

absl::Status SendMessage(int sock, const void* data, size_t n, absl::Span<const int> fds) {
  if (fds.size() > kMaxFds) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor socket: ", fds.size(), " descriptors; at most ", kMaxFds));
  }
  iovec iov{const_cast<void*>(data), n};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  if (!fds.empty()) {
    std::memset(control, 0, sizeof control);
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t sent;
  do {
    sent = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) {
    return absl::UnavailableError(
        absl::StrCat("descriptor socket: send: ", std::strerror(errno)));
  }
  if (static_cast<size_t>(sent) != n) {
    return absl::UnavailableError("descriptor socket: short send");
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> ReceiveMessage(int sock, void* data, size_t cap,
                                      std::vector<UniqueFd>* fds) {
  fds->clear();
  iovec iov{data, cap};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t got;
  do {
    got = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    return absl::UnavailableError(
        absl::StrCat("descriptor socket: receive: ", std::strerror(errno)));
  }
  // Own every descriptor that arrived before looking at anything else.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      fds->emplace_back(fd);
    }
  }
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    fds->clear();
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor socket: message truncated (more than ", cap, " bytes or ", kMaxFds,
        " descriptors)"));
  }
  if (got == 0) {
    // A sequenced-packet socket reads 0 bytes both for an empty message and
    // at the peer's close; only a close leaves the socket hung up.
    pollfd p{sock, POLLRDHUP, 0};
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP)) != 0) {
      return absl::UnavailableError("descriptor socket: peer closed the connection");
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor socket: the message is empty; send one request (", sizeof(Request),
        " bytes, dos/wire/fd_protocol.h) per message, as libdos_client does"));
  }
  return static_cast<size_t>(got);
}

namespace {

absl::Status TimedOut(const std::string& fd_socket, absl::Duration timeout, const char* what) {
  return absl::DeadlineExceededError(absl::StrCat(
      "dosd's descriptor socket ", fd_socket, " did not ", what, " within ",
      absl::FormatDuration(timeout), "; dosd is busy or stopped answering: try again, or raise "
      "the client's timeout"));
}

}  // namespace

absl::StatusOr<Exchange> Call(const std::string& fd_socket, const Request& request,
                              absl::Span<const int> fds, absl::Duration timeout) {
  sockaddr_un addr{};
  if (fd_socket.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor socket path ", fd_socket, " is too long"));
  }
  const absl::Time deadline = absl::Now() + timeout;
  UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!sock.valid()) {
    return absl::InternalError(absl::StrCat("descriptor socket: socket: ", std::strerror(errno)));
  }
  // Bounds connect (a full accept queue) and send.
  // (At least 1 ms: a zero timeval would mean "wait forever".)
  const timeval send_tv = absl::ToTimeval(std::max(timeout, absl::Milliseconds(1)));
  ::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &send_tv, sizeof send_tv);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, fd_socket.data(), fd_socket.size());
  if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno == EAGAIN || errno == EINPROGRESS) return TimedOut(fd_socket, timeout, "accept");
    return absl::UnavailableError(absl::StrCat(
        "cannot connect to dosd's descriptor socket ", fd_socket, ": ", std::strerror(errno),
        "; is dosd (of this release) running on the socket beside it?"));
  }
  // A refused connection is answered and closed at once, perhaps before our
  // request went out: then the answer is the reason, not the send's EPIPE.
  const absl::Status sent = SendMessage(sock.get(), &request, sizeof request, fds);
  pollfd p{sock.get(), POLLIN, 0};
  if (!sent.ok() && ::poll(&p, 1, 0) != 1) return sent;
  int ready;
  do {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    ready = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left_ms, 0, INT32_MAX)));
  } while (ready < 0 && errno == EINTR);
  if (ready == 0) return TimedOut(fd_socket, timeout, "answer");
  Exchange ex;
  alignas(Reply) char buf[sizeof(Reply) + 1];
  absl::StatusOr<size_t> n = ReceiveMessage(sock.get(), buf, sizeof buf, &ex.fds);
  if (!n.ok() && ::poll(&p, 1, 0) == 1) {
    // Closed with our request unread, the connection reports ECONNRESET
    // once; the answer that says why is queued behind it.
    n = ReceiveMessage(sock.get(), buf, sizeof buf, &ex.fds);
  }
  if (!n.ok()) return n.status();
  absl::StatusOr<Reply> reply = ParseReply(buf, *n, ex.fds.size());
  if (!reply.ok()) return reply.status();
  ex.reply = *reply;
  ex.connection = std::move(sock);
  if (ex.reply.status_code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(ex.reply.status_code),
                        ReplyText(ex.reply));
  }
  return ex;
}

absl::StatusOr<std::string> Hello(const std::string& fd_socket, absl::Duration timeout) {
  absl::StatusOr<Exchange> ex = Call(fd_socket, MakeRequest(Op::kHello, 0, "", 0), {}, timeout);
  if (!ex.ok()) return ex.status();
  return ReplyText(ex->reply);
}

absl::StatusOr<ControlBlockHandle> FetchControlBlock(const std::string& fd_socket,
                                                     uint64_t session_id, absl::string_view token,
                                                     absl::Duration timeout) {
  absl::StatusOr<Exchange> ex =
      Call(fd_socket, MakeRequest(Op::kControlBlock, session_id, token, 0), {}, timeout);
  if (!ex.ok()) return ex.status();
  if (ex->fds.size() != 1) {
    return absl::InternalError("descriptor socket: control block reply carried no descriptor");
  }
  return ControlBlockHandle{std::move(ex->fds[0]), std::move(ex->connection)};
}

absl::StatusOr<StateMemoryHandle> FetchStateMemory(const std::string& fd_socket,
                                                   uint64_t session_id, absl::string_view token,
                                                   absl::Duration timeout) {
  absl::StatusOr<Exchange> ex =
      Call(fd_socket, MakeRequest(Op::kStateMemory, session_id, token, 0), {}, timeout);
  if (!ex.ok()) return ex.status();
  if (ex->fds.size() != 2) {
    return absl::InternalError("descriptor socket: state memory reply carried no descriptors");
  }
  return StateMemoryHandle{std::move(ex->fds[0]), std::move(ex->fds[1])};
}

absl::StatusOr<std::vector<uint64_t>> SendSegments(const std::string& fd_socket,
                                                   uint64_t session_id, absl::string_view token,
                                                   absl::Span<const int> fds,
                                                   absl::Duration timeout) {
  std::vector<uint64_t> ids;
  for (size_t first = 0; first < fds.size(); first += kMaxFds) {
    absl::Span<const int> part = fds.subspan(first, kMaxFds);
    absl::StatusOr<Exchange> ex =
        Call(fd_socket,
             MakeRequest(Op::kSegments, session_id, token, static_cast<uint32_t>(part.size())),
             part, timeout);
    if (!ex.ok()) return ex.status();
    if (ex->reply.count != part.size()) {
      return absl::InternalError(absl::StrCat("descriptor socket: ", part.size(),
                                              " segments sent, ", ex->reply.count, " ids back"));
    }
    ids.insert(ids.end(), ex->reply.segment_ids, ex->reply.segment_ids + ex->reply.count);
  }
  return ids;
}

}  // namespace dos::fdproto
