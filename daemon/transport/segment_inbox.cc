#include "daemon/transport/segment_inbox.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace dos {

absl::StatusOr<std::vector<uint64_t>> SegmentInbox::AddAll(
    std::vector<std::unique_ptr<ShmSegment>> segments) {
  absl::MutexLock lock(&mu_);
  if (segments.size() > kMaxPending - segments_.size()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session has ", segments_.size(), " segments waiting and was sent ", segments.size(),
        " more; at most ", kMaxPending, " may wait: register or transfer with those first"));
  }
  std::vector<uint64_t> ids;
  for (auto& s : segments) {
    ids.push_back(next_id_);
    segments_.emplace(next_id_++, std::move(s));
  }
  return ids;
}

absl::StatusOr<std::unique_ptr<ShmSegment>> SegmentInbox::Take(uint64_t id,
                                                               absl::string_view what) {
  absl::MutexLock lock(&mu_);
  auto it = segments_.find(id);
  if (it == segments_.end()) {
    return absl::NotFoundError(absl::StrCat(
        what, ": segment ", id, " was not sent to this session (or was already used); send the "
        "buffer's memfd over dosd's descriptor socket first and use the id it answers"));
  }
  std::unique_ptr<ShmSegment> s = std::move(it->second);
  segments_.erase(it);
  return s;
}

size_t SegmentInbox::pending() const {
  absl::MutexLock lock(&mu_);
  return segments_.size();
}

}  // namespace dos
