#include "daemon/transport/shm_transport.h"

#include "absl/strings/str_cat.h"

namespace dos {

absl::StatusOr<void*> ShmTransport::Map(const MemoryRef& ref, uint64_t bytes,
                                        absl::string_view what) {
  auto it = segments_.find(ref.shm_name);
  if (it == segments_.end()) {
    absl::StatusOr<std::unique_ptr<ShmSegment>> seg = ShmSegment::Open(ref.shm_name);
    if (!seg.ok()) {
      return absl::Status(seg.status().code(),
                          absl::StrCat(what, ": ", seg.status().message()));
    }
    it = segments_.emplace(ref.shm_name, *std::move(seg)).first;
  }
  const ShmSegment& seg = *it->second;
  if (ref.offset > seg.size() || bytes > seg.size() - ref.offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": range [", ref.offset, ", ", ref.offset + bytes, ") overruns shm ",
                     ref.shm_name, " of ", seg.size(), " bytes; the tensor does not fit in the "
                     "buffer it names"));
  }
  return static_cast<char*>(seg.data()) + ref.offset;
}

}  // namespace dos
