#include "buffer_table.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dos::client {

void BufferTable::Add(std::string name, const void* base, uint64_t bytes) {
  Entry e{std::move(name), reinterpret_cast<uintptr_t>(base), bytes};
  auto it = std::upper_bound(buffers_.begin(), buffers_.end(), e.base,
                             [](uintptr_t b, const Entry& x) { return b < x.base; });
  buffers_.insert(it, std::move(e));
}

void BufferTable::Remove(std::string_view name) {
  std::erase_if(buffers_, [&](const Entry& e) { return e.name == name; });
}

bool BufferTable::Contains(const void* ptr) const {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  auto it = std::upper_bound(buffers_.begin(), buffers_.end(), p,
                             [](uintptr_t v, const Entry& x) { return v < x.base; });
  return it != buffers_.begin() && p - std::prev(it)->base < std::prev(it)->bytes;
}

absl::StatusOr<BufferRef> BufferTable::Resolve(const void* ptr, uint64_t bytes,
                                               const std::string& what) const {
  if (ptr == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is NULL"));
  }
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  // The last buffer whose base is <= p is the only candidate.
  auto it = std::upper_bound(buffers_.begin(), buffers_.end(), p,
                             [](uintptr_t v, const Entry& x) { return v < x.base; });
  if (it == buffers_.begin() || p - std::prev(it)->base >= std::prev(it)->bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " at 0x", absl::Hex(p), " is not inside a buffer from dos_buffer_alloc (",
        buffers_.size(),
        " allocated); the daemon can only reach memory allocated by this session"));
  }
  const Entry& e = *std::prev(it);
  const uint64_t offset = p - e.base;
  if (bytes > e.bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " at 0x", absl::Hex(p), " spans ", bytes, " bytes from offset ", offset,
        " of buffer ", e.name, ", which has only ", e.bytes - offset,
        " bytes left; check numel and dtype"));
  }
  return BufferRef{e.name, offset};
}

}  // namespace dos::client
