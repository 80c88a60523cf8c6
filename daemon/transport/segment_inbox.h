// SegmentInbox: a session's memory segments that arrived over the descriptor
// socket (fd_server.h) and wait to be used by id.
//
// The descriptor server checks each descriptor (sealed memfd, ShmSegment::
// Adopt) and files the mapped segment here under a fresh id; RegisterShard
// (through ShmTransport) and Export/ImportState take segments out by id.
// Ids are per session, start at 1 and are never reused. Segments never
// taken are freed with the session.
//
// Thread-safety: thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "dos/wire/shm_segment.h"

namespace dos {

class SegmentInbox {
 public:
  // Segments waiting at once; more is RESOURCE_EXHAUSTED.
  static constexpr size_t kMaxPending = 16384;

  // Files all of `segments` or none; returns their ids in order.
  absl::StatusOr<std::vector<uint64_t>> AddAll(std::vector<std::unique_ptr<ShmSegment>> segments);
  // Removes and returns segment `id`; NOT_FOUND naming `what` otherwise.
  absl::StatusOr<std::unique_ptr<ShmSegment>> Take(uint64_t id, absl::string_view what);
  size_t pending() const;

 private:
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::unique_ptr<ShmSegment>> segments_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace dos
