// The descriptor socket: how memory travels between a trainer and dosd.
//
// gRPC cannot carry file descriptors or tell dosd who is calling, so dosd
// serves a unix SOCK_SEQPACKET socket, "<socket>.fd", beside the gRPC one.
// Each connection carries one Request (with up to kMaxFds descriptors as
// SCM_RIGHTS) and one Reply (likewise), then closes:
//
//   kHello          -> OK, text = ticket. dosd records the caller's identity
//                      from the kernel (SO_PEERCRED: uid, gid, pid in dosd's
//                      pid namespace; a pidfd for liveness) under a random
//                      single-use ticket (30 s). Attach must carry it
//                      (AttachRequest.fd_ticket): the session belongs to that
//                      process and uid, whatever pid the request claims.
//   kControlBlock   -> OK + 1 fd: the session's control block, a sealed memfd
//                      dosd created. Needs session_id + token, and the caller's
//                      uid must be the session's.
//   kSegments + fds -> OK, segment_ids[i] for fds[i]: dosd checked and mapped
//                      each (sealed memfds only, see shm_segment.h) into the
//                      session's inbox; RegisterShard and Export/ImportState
//                      name them by id (ShmLocation.segment). Same session
//                      checks as kControlBlock.
//   kStateMemory    -> OK + 2 fds: the session's optimizer state memfd,
//                      read-only, and a sealed memfd holding its state map
//                      (state_map.h), after dosd brought resident state home.
//                      Same session checks as kControlBlock. The owner's
//                      state_dict() maps its state from them: nothing copied.
//
// Every field is fixed size; ParseRequest/ParseReply validate a received
// buffer (the fuzz target's entry points).
//
// Thread-safety: the functions are thread-safe (no shared state).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "dos/wire/unique_fd.h"

namespace dos::fdproto {

inline constexpr uint32_t kMagic = 0x46534f44;  // "DOSF"
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kMaxFds = 64;          // descriptors per message
inline constexpr size_t kTokenBytes = 64;        // session token, NUL-padded
inline constexpr size_t kTextBytes = 512;        // ticket or error message, NUL-terminated

enum class Op : uint32_t { kHello = 1, kControlBlock = 2, kSegments = 3, kStateMemory = 4 };

struct Request {
  uint32_t magic;
  uint32_t version;
  uint32_t op;       // Op
  uint32_t num_fds;  // descriptors attached (kSegments only)
  uint64_t session_id;
  char token[kTokenBytes];
};

struct Reply {
  uint32_t magic;
  uint32_t version;
  int32_t status_code;  // absl::StatusCode
  uint32_t num_fds;     // descriptors attached (kControlBlock: 1)
  uint32_t count;       // valid entries of segment_ids
  uint32_t reserved;
  uint64_t segment_ids[kMaxFds];
  char text[kTextBytes];
};

// The socket beside the gRPC socket `grpc_socket`.
std::string SocketPathFor(const std::string& grpc_socket);

Request MakeRequest(Op op, uint64_t session_id, absl::string_view token, uint32_t num_fds);
Reply MakeReply(const absl::Status& status);
// `text` of a reply, bounded by kTextBytes.
std::string ReplyText(const Reply& reply);
// The token of a request, bounded by kTokenBytes.
std::string RequestToken(const Request& request);

// Validates `n` received bytes carrying `fds_received` descriptors as a
// Request: size, magic, version, op, fd count matching num_fds and the op.
absl::StatusOr<Request> ParseRequest(const void* data, size_t n, size_t fds_received);
absl::StatusOr<Reply> ParseReply(const void* data, size_t n, size_t fds_received);

// One message with descriptors (SCM_RIGHTS) on a SOCK_SEQPACKET socket.
absl::Status SendMessage(int sock, const void* data, size_t n, absl::Span<const int> fds);
// Receives one message of at most `cap` bytes; *fds gets every descriptor that
// came with it (close-on-exec, owned). Returns the byte count; an error if the
// message or its descriptors were truncated (any received ones are closed).
absl::StatusOr<size_t> ReceiveMessage(int sock, void* data, size_t cap,
                                      std::vector<UniqueFd>* fds);

// Client side: one request/reply exchange with dosd's descriptor socket,
// connect to reply within `timeout` (DEADLINE_EXCEEDED naming the path
// after it: dosd busy, or its queue full). UNAVAILABLE (naming the path)
// when nothing listens there.
inline constexpr absl::Duration kDefaultCallTimeout = absl::Seconds(30);
struct Exchange {
  Reply reply;
  std::vector<UniqueFd> fds;
  UniqueFd connection;  // still open
};
absl::StatusOr<Exchange> Call(const std::string& fd_socket, const Request& request,
                              absl::Span<const int> fds,
                              absl::Duration timeout = kDefaultCallTimeout);
absl::StatusOr<std::string> Hello(const std::string& fd_socket,
                                  absl::Duration timeout = kDefaultCallTimeout);
// The control block's memfd, and the connection it came on: dosd keeps its
// end open for the session's life, so a hang-up (poll: readable) means dosd
// or the session is gone, in any pid namespace.
struct ControlBlockHandle {
  UniqueFd memfd;
  UniqueFd connection;
};
absl::StatusOr<ControlBlockHandle> FetchControlBlock(const std::string& fd_socket,
                                                     uint64_t session_id, absl::string_view token,
                                                     absl::Duration timeout = kDefaultCallTimeout);
// kStateMemory: {state memfd (read-only), state map memfd}.
struct StateMemoryHandle {
  UniqueFd state;
  UniqueFd map;
};
absl::StatusOr<StateMemoryHandle> FetchStateMemory(const std::string& fd_socket,
                                                   uint64_t session_id, absl::string_view token,
                                                   absl::Duration timeout = kDefaultCallTimeout);
// `timeout` bounds each exchange (one per kMaxFds descriptors).
absl::StatusOr<std::vector<uint64_t>> SendSegments(const std::string& fd_socket,
                                                   uint64_t session_id, absl::string_view token,
                                                   absl::Span<const int> fds,
                                                   absl::Duration timeout = kDefaultCallTimeout);

}  // namespace dos::fdproto
