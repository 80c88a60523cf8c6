// libFuzzer target: the descriptor socket's handshake (daemon/transport/
// fd_server.h) as dosd serves it, minus the socket: arbitrary request bytes
// with 0 to 4 descriptors of arbitrary kinds (sealed, unsealed and
// write-sealed memfds, a pipe, a regular file) go through
// DescriptorServer::Handle against one session (id 7, token "secret"). Every
// input must get a reply; descriptors that are not sealed memfds must be
// refused; nothing may leak (the inbox is drained each round). The reply
// parser is fed the same bytes.
//
// Input: byte 0: number of descriptors (mod 5); byte 1..4: their kinds; the
// rest: the request.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "daemon/transport/fd_server.h"
#include "dos/wire/fd_protocol.h"
#include "dos/wire/shm_segment.h"

namespace {

dos::UniqueFd MakeFd(uint8_t kind) {
  switch (kind % 5) {
    case 0:
    case 1:
    case 2: {
      dos::UniqueFd fd(memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING));
      if (ftruncate(fd.get(), 4096 * (1 + kind / 5 % 4)) != 0) return dos::UniqueFd();
      int seals = kind % 5 == 0   ? dos::ShmSegment::kRequiredSeals
                  : kind % 5 == 1 ? F_SEAL_SHRINK
                                  : dos::ShmSegment::kRequiredSeals | F_SEAL_WRITE;
      fcntl(fd.get(), F_ADD_SEALS, seals);
      return fd;
    }
    case 3: {
      int p[2];
      if (pipe2(p, O_CLOEXEC) != 0) return dos::UniqueFd();
      close(p[1]);
      return dos::UniqueFd(p[0]);
    }
    default:
      return dos::UniqueFd(open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  }
}

struct World {
  World() {
    control = *dos::ShmSegment::Create("fuzz.ctl", 4096);
    caller = *dos::PeerProcess::FromPid(getpid());
    server = dos::DescriptorServer::ForTesting(
        dos::DescriptorServer::Options{},
        [this](uint64_t id, absl::string_view token,
               const dos::PeerProcess&) -> absl::StatusOr<dos::SessionPort> {
          if (id != 7) return absl::NotFoundError("no session");
          if (token != "secret") return absl::PermissionDeniedError("token");
          dos::SessionPort p;
          p.control_fd = control->fd();
          p.inbox = &inbox;
          return p;
        });
  }
  std::unique_ptr<dos::ShmSegment> control;
  std::shared_ptr<const dos::PeerProcess> caller;
  dos::SegmentInbox inbox;
  std::unique_ptr<dos::DescriptorServer> server;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* world = new World();
  if (size < 5) return 0;
  const size_t nfds = data[0] % 5;
  std::vector<dos::UniqueFd> fds;
  for (size_t i = 0; i < nfds; ++i) fds.push_back(MakeFd(data[1 + i]));
  int send_fd = -1;
  dos::fdproto::Reply reply =
      world->server->Handle(data + 5, size - 5, std::move(fds), world->caller, &send_fd);
  if (reply.status_code == 0 && reply.count > 0) {
    // Only sealed memfds may have been filed.
    for (uint32_t i = 0; i < reply.count && i < dos::fdproto::kMaxFds; ++i) {
      absl::StatusOr<std::unique_ptr<dos::ShmSegment>> s =
          world->inbox.Take(reply.segment_ids[i], "fuzz");
      if (!s.ok()) std::abort();
    }
  }
  if (world->inbox.pending() != 0) std::abort();
  if (send_fd >= 0 && send_fd != world->control->fd()) std::abort();
  // Tickets a Hello issued are redeemed, so the per-uid cap never fills.
  if (reply.status_code == 0 && reply.text[0] != '\0') {
    (void)world->server->Redeem(dos::fdproto::ReplyText(reply));
  }
  (void)dos::fdproto::ParseReply(data + 5, size - 5, nfds);
  return 0;
}
