// DescriptorServer: dosd's end of the descriptor socket (proto/dos/wire/
// fd_protocol.h), "<socket>.fd" beside the gRPC socket, with the same mode
// and group.
//
// - Hello: the caller's identity from the kernel (PeerProcess) is kept under
//   a random single-use ticket for 30 s; Attach redeems it (Redeem), so a
//   session belongs to the process that connected here and to its uid.
// - ControlBlock / Segments: `resolve` finds the session by id and token and
//   checks that the caller's uid owns it (it is dosd's session manager); the
//   control block's memfd is sent back, or the received memfds are checked
//   (sealed, ShmSegment::Adopt) and filed in the session's SegmentInbox.
//
// Connections are served concurrently: the accepting thread ("dos-fd", a
// SocketListener: daemon/common/socket_listener.h) only reads the peer's
// identity, charges its uid one connection (UidLedger, --max_fd_connections_
// per_uid; past it, or past Options::max_connections in all, the connection
// is answered RESOURCE_EXHAUSTED and closed) and hands it to the serving
// thread ("dos-fd-io"), which polls every waiting connection and serves each
// as soon as its request has arrived. A request is one message and Handle
// never waits on a client, so an idle connection delays no one; one that
// sends nothing within Options::request_deadline is answered
// DEADLINE_EXCEEDED and closed.
// While dosd's descriptors run short (Options::reserve), a uid that holds
// more than a few sessions is refused once its request is read.
// A state memory request (kStateMemory) may wait for its session's step
// (Session::ThroughGate: up to 11 s for a trainer that stalls): it is
// served off the serving thread, by at most kSlowThreadsPerUid threads of
// its uid's own, in order, so that a stalled or hostile trainer delays only
// its own uid's state requests, never another user's attach.
//
// Thread-safety: thread-safe.
#pragma once

#include <sys/types.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/common/fd_limits.h"
#include "daemon/common/socket_listener.h"
#include "daemon/common/uid_ledger.h"
#include "daemon/transport/peer_process.h"
#include "daemon/transport/segment_inbox.h"
#include "dos/wire/fd_protocol.h"
#include "dos/wire/unique_fd.h"

namespace dos {

// What the descriptor server may touch of one session.
struct SessionPort {
  int control_fd = -1;  // the control block's memfd (sent as a dup without control_block)
  // A descriptor of the control block to send (Session::ControlBlockFd); may
  // be empty.
  std::function<absl::StatusOr<UniqueFd>()> control_block;
  SegmentInbox* inbox = nullptr;
  // Takes the connection a control block was sent on and keeps it open for
  // the session's life (its hang-up is the client's sign that dosd or the
  // session is gone); may be empty.
  std::function<void(UniqueFd)> hold_connection;
  // The owner's view of its state (Op::kStateMemory): the state memfd
  // (read-only) and its state map; may be empty.
  std::function<absl::StatusOr<std::vector<UniqueFd>>()> state_memory;
  std::shared_ptr<void> keep_alive;  // holds the session while the port is used
  // The session's share of its uid's bounds: segments are charged to it
  // (kMappedBytes) before they are mapped. Null: not charged.
  std::shared_ptr<UidLedger::Account> account;
};

class DescriptorServer {
 public:
  // PERMISSION_DENIED / NOT_FOUND as the session manager answers them.
  using ResolveFn = std::function<absl::StatusOr<SessionPort>(
      uint64_t session_id, absl::string_view token, const PeerProcess& caller)>;

  struct Options {
    mode_t socket_mode = 0660;
    gid_t group = static_cast<gid_t>(-1);
    absl::Duration ticket_life = absl::Seconds(30);
    size_t max_tickets = 4096;         // outstanding, all callers
    size_t max_tickets_per_uid = 64;   // outstanding, one uid
    // Connections per uid (kConnections) are charged here; null: no per-uid
    // bound. Outlives the server.
    UidLedger* ledger = nullptr;
    size_t max_connections = 1024;     // waiting for their request, all uids
    absl::Duration request_deadline = absl::Seconds(2);  // connect to request
    // Descriptors kept for uids that hold no session (daemon/common/
    // fd_limits.h); null: none. `sessions_of` counts a uid's sessions.
    std::shared_ptr<const FdReserve> reserve;
    std::function<uint64_t(uint32_t uid)> sessions_of;
  };

  static absl::StatusOr<std::unique_ptr<DescriptorServer>> Start(const std::string& path,
                                                                 Options options,
                                                                 ResolveFn resolve);
  // Without a socket: Handle() only (tests, the fuzz target).
  static std::unique_ptr<DescriptorServer> ForTesting(Options options, ResolveFn resolve);
  // Stops both threads, removes the socket; waits for the state memory
  // requests being served (at most the session gate's wait), refuses the
  // queued ones.
  ~DescriptorServer();

  // Threads serving one uid's state memory requests at most.
  static constexpr int kSlowThreadsPerUid = 2;

  const std::string& path() const { return path_; }

  // For Attach: the identity a Hello recorded under `ticket` (consumed).
  // PERMISSION_DENIED, saying what to do, for a missing/unknown/expired one.
  absl::StatusOr<std::shared_ptr<const PeerProcess>> Redeem(absl::string_view ticket);

  // Serves one received request from `caller` (the connection's peer).
  // *send_fd: a descriptor to send with the reply, or -1; *port: the session
  // a control block request resolved to (for the connection hand-over).
  // *owned: descriptors to send with the reply and close after (kStateMemory).
  fdproto::Reply Handle(const void* data, size_t n, std::vector<UniqueFd> fds,
                        const std::shared_ptr<const PeerProcess>& caller, int* send_fd,
                        SessionPort* port = nullptr, std::vector<UniqueFd>* owned = nullptr);

 private:
  DescriptorServer(std::string path, Options options, ResolveFn resolve)
      : path_(std::move(path)), options_(std::move(options)), resolve_(std::move(resolve)) {}
  // A connection accepted and charged, waiting for its request.
  struct Waiting {
    UniqueFd conn;
    std::shared_ptr<const PeerProcess> caller;
    LedgerCharge charge;  // one of kConnections
    absl::Time deadline;
  };
  // On the accepting thread: identity, charge, hand-over to the serving one.
  void Accept(UniqueFd conn);
  // The serving thread: polls the waiting connections.
  void ServeLoop();
  // Receives, handles and answers one request (the connection is readable);
  // a state memory request is queued for its uid's threads (Queue).
  void Serve(Waiting w);
  // Handles `request` and sends the reply on w.conn.
  void Answer(Waiting w, const std::string& request, std::vector<UniqueFd> fds);
  // A request served off the serving thread, and one uid's queue of them.
  struct Slow {
    Waiting w;
    std::string request;
    std::vector<UniqueFd> fds;
  };
  struct SlowQueue {
    std::deque<Slow> items;
    int threads = 0;
  };
  void Queue(Slow slow);
  void SlowWorker(uint32_t uid);
  absl::StatusOr<std::string> IssueTicket(std::shared_ptr<const PeerProcess> caller);
  fdproto::Reply ReceiveSegments(const fdproto::Request& req, std::vector<UniqueFd> fds,
                                 const PeerProcess& caller, const SessionPort& port);

  const std::string path_;
  const Options options_;
  const ResolveFn resolve_;

  struct Ticket {
    std::shared_ptr<const PeerProcess> process;
    absl::Time expires;
  };
  absl::Mutex mu_;
  std::map<std::string, Ticket> tickets_ ABSL_GUARDED_BY(mu_);
  // Accepted connections not yet taken by the serving thread, and the
  // number of connections waiting in all (both threads').
  std::vector<Waiting> incoming_ ABSL_GUARDED_BY(mu_);
  size_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint32_t, SlowQueue> slow_ ABSL_GUARDED_BY(mu_);
  size_t slow_requests_ ABSL_GUARDED_BY(mu_) = 0;  // queued or being served, all uids
  int slow_threads_ ABSL_GUARDED_BY(mu_) = 0;      // the destructor waits for none
  UniqueFd wake_;  // eventfd: new connections, or stop
  std::thread io_thread_;
  // The destructor stops the listener, then the serving thread, before the
  // tickets and connections they use go.
  std::unique_ptr<SocketListener> listener_;  // null: ForTesting
};

}  // namespace dos
