// ShmTransport: Transport over POSIX shared memory created by the client
// (dos/wire/shm_segment.h). Each distinct object is opened and
// mapped once; ranges are checked against the object's size.
//
// Thread-safety: not thread-safe (see transport.h).
#pragma once

#include <map>
#include <memory>
#include <string>

#include "dos/wire/shm_segment.h"
#include "daemon/transport/transport.h"

namespace dos {

class ShmTransport final : public Transport {
 public:
  absl::StatusOr<void*> Map(const MemoryRef& ref, uint64_t bytes, absl::string_view what) override;
  size_t num_segments() const { return segments_.size(); }

 private:
  std::map<std::string, std::unique_ptr<ShmSegment>> segments_;
};

}  // namespace dos
