#include "daemon/transport/shm_transport.h"

#include "absl/strings/str_cat.h"

namespace dos {

absl::StatusOr<void*> ShmTransport::Map(const MemoryRef& ref, uint64_t bytes,
                                        absl::string_view what) {
  if (ref.segment == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": names no memory segment (segment id ", ref.segment_id,
        "); shared memory is passed by descriptor: send the sealed memfd over dosd's descriptor "
        "socket and name the id it answers (libdos_client does this)"));
  }
  const ShmSegment& seg = *ref.segment;
  if (ref.offset > seg.size() || bytes > seg.size() - ref.offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": range [", ref.offset, ", ", ref.offset + bytes, ") overruns segment ",
                     ref.segment_id, " of ", seg.size(), " bytes; the tensor does not fit in the "
                     "buffer it names"));
  }
  segments_.emplace(ref.segment.get(), ref.segment);
  return static_cast<char*>(seg.data()) + ref.offset;
}

}  // namespace dos
