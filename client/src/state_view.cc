#include "state_view.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "dos/wire/fd_protocol.h"

namespace dos::client {
namespace {
constexpr uint64_t kPage = 4096;
}  // namespace

absl::Status StateViews::Fetch(const std::string& fd_socket, uint64_t session_id,
                               absl::string_view token) {
  absl::StatusOr<fdproto::StateMemoryHandle> h =
      fdproto::FetchStateMemory(fd_socket, session_id, token);
  if (!h.ok()) return h.status();
  struct stat st{};
  if (::fstat(h->map.get(), &st) != 0 || st.st_size <= 0 || st.st_size > (int64_t{1} << 32)) {
    return absl::DataLossError("state map from dosd: cannot size it");
  }
  std::vector<uint64_t> buf((static_cast<size_t>(st.st_size) + 7) / 8);
  size_t done = 0;
  while (done < static_cast<size_t>(st.st_size)) {
    const ssize_t n = ::pread(h->map.get(), reinterpret_cast<char*>(buf.data()) + done,
                              static_cast<size_t>(st.st_size) - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::DataLossError("state map from dosd: short read");
    done += static_cast<size_t>(n);
  }
  absl::StatusOr<statemap::StateMap> m = statemap::ParseStateMap(
      {reinterpret_cast<const std::byte*>(buf.data()), static_cast<size_t>(st.st_size)});
  if (!m.ok()) return m.status();
  header_ = m->header;
  tensors_.assign(m->tensors.begin(), m->tensors.end());
  runs_.assign(m->runs.begin(), m->runs.end());
  state_ = std::move(h->state);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StateViews::Step(uint32_t tensor) const {
  if (tensor >= tensors_.size()) {
    return absl::OutOfRangeError(absl::StrCat("state view: tensor ", tensor, " of ",
                                              tensors_.size(), " (fetch the state map first)"));
  }
  return tensors_[tensor].step;
}

absl::StatusOr<StateView> StateViews::Map(uint32_t tensor, int which) const {
  if (tensor >= tensors_.size() || which < 0 || which > 2) {
    return absl::OutOfRangeError(absl::StrCat("state view: tensor ", tensor, " array ", which,
                                              " (", tensors_.size(), " tensors, arrays 0-2)"));
  }
  const statemap::StateMapTensor& t = tensors_[tensor];
  StateView v;
  v.numel = t.numel;
  v.elem_bytes = which == 0 ? 4 : header_.moment_bytes;
  const uint64_t bytes = t.numel * v.elem_bytes;
  v.map_bytes = (bytes + kPage - 1) / kPage * kPage;
  if (v.map_bytes == 0) return absl::FailedPreconditionError("state view: empty tensor");
  for (uint64_t r = t.first_run; r < t.first_run + t.num_runs; ++r) {
    if (runs_[r].file_offset[which] % kPage != 0 ||
        runs_[r].tensor_offset * v.elem_bytes % kPage != 0) {
      return absl::FailedPreconditionError(
          "state view: the tensor's runs are not page-aligned; read a copy");
    }
  }
  void* base = ::mmap(nullptr, v.map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("state view: cannot reserve ", v.map_bytes, " bytes: ", std::strerror(errno)));
  }
  char* b = static_cast<char*>(base);
  for (uint64_t r = t.first_run; r < t.first_run + t.num_runs; ++r) {
    const statemap::StateMapRun& run = runs_[r];
    const uint64_t at = run.tensor_offset * v.elem_bytes;
    uint64_t len = (run.count * v.elem_bytes + kPage - 1) / kPage * kPage;
    len = std::min(len, v.map_bytes - at);
    if (::mmap(b + at, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, state_.get(),
               static_cast<off_t>(run.file_offset[which])) == MAP_FAILED) {
      const int err = errno;
      ::munmap(base, v.map_bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat("state view: cannot map tensor ", tensor, ": ", std::strerror(err)));
    }
  }
  v.addr = base;
  return v;
}

absl::StatusOr<bool> StateViews::Modified(void* addr, uint64_t map_bytes) {
  constexpr uint64_t kPresent = uint64_t{1} << 63;
  constexpr uint64_t kFileOrShared = uint64_t{1} << 61;
  UniqueFd pm(::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC));
  if (!pm.valid()) {
    return absl::UnavailableError(
        absl::StrCat("state view: /proc/self/pagemap: ", std::strerror(errno)));
  }
  const uint64_t first = reinterpret_cast<uintptr_t>(addr) / kPage;
  const uint64_t pages = (map_bytes + kPage - 1) / kPage;
  std::vector<uint64_t> e(std::min<uint64_t>(pages, 1 << 16));
  for (uint64_t done = 0; done < pages;) {
    const uint64_t n = std::min<uint64_t>(e.size(), pages - done);
    const ssize_t got = ::pread(pm.get(), e.data(), n * 8, static_cast<off_t>((first + done) * 8));
    if (got <= 0) {
      return absl::UnavailableError(
          absl::StrCat("state view: /proc/self/pagemap: ", std::strerror(errno)));
    }
    const uint64_t k = static_cast<uint64_t>(got) / 8;
    for (uint64_t i = 0; i < k; ++i) {
      if ((e[i] & kPresent) != 0 && (e[i] & kFileOrShared) == 0) return true;
    }
    done += k;
  }
  return false;
}

absl::Status StateViews::Unmap(void* addr, uint64_t map_bytes) {
  if (addr == nullptr || ::munmap(addr, map_bytes) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("state view: cannot unmap ", map_bytes,
                                                   " bytes: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace dos::client
