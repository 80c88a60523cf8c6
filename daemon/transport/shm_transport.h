// ShmTransport: Transport over the client's sealed memfd segments
// (dos/wire/shm_segment.h), already mapped when they arrived on the
// descriptor socket; the session resolves each MemoryRef's segment id to its
// segment. The transport keeps the segments mapped for the session's life and
// checks ranges against their sizes. Nothing is opened by name.
//
// Thread-safety: not thread-safe (see transport.h).
#pragma once

#include <map>
#include <memory>

#include "dos/wire/shm_segment.h"
#include "daemon/transport/transport.h"

namespace dos {

class ShmTransport final : public Transport {
 public:
  absl::StatusOr<void*> Map(const MemoryRef& ref, uint64_t bytes, absl::string_view what) override;
  size_t num_segments() const { return segments_.size(); }

 private:
  std::map<const ShmSegment*, std::shared_ptr<ShmSegment>> segments_;
};

}  // namespace dos
