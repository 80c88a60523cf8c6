#include "dos/wire/shm_segment.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "boost/interprocess/detail/os_file_functions.hpp"
#include "boost/interprocess/exceptions.hpp"
#include "boost/interprocess/mapped_region.hpp"

namespace dos {
namespace {

namespace bip = boost::interprocess;

static_assert(ShmSegment::kRequiredSeals == (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL));

// Lets Boost.Interprocess map a descriptor it did not open (its
// MemoryMappable concept: get_mapping_handle()).
struct FdMappable {
  int fd;
  bip::mapping_handle_t get_mapping_handle() const {
    return bip::ipcdetail::mapping_handle_from_file_handle(fd);
  }
};

absl::StatusCode CodeFor(int err) {
  switch (err) {
    case EPERM:
    case EACCES:
      return absl::StatusCode::kPermissionDenied;
    case ENOSPC:
    case ENOMEM:
    case EFBIG:
    case EMFILE:
    case ENFILE:
      return absl::StatusCode::kResourceExhausted;
    case EINVAL:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

// "shm: cannot <what>: <strerror>; <hint>"
absl::Status ErrnoStatus(int err, absl::string_view what) {
  std::string message = absl::StrCat("shm: cannot ", what, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case ENOMEM:
    case EFBIG:
      absl::StrAppend(&message, "; free memory or lower the buffer sizes");
      break;
    case EMFILE:
    case ENFILE:
      absl::StrAppend(&message, "; too many open files: raise the limit (ulimit -n, LimitNOFILE=)");
      break;
    default:
      break;
  }
  return absl::Status(CodeFor(err), message);
}

absl::StatusOr<std::unique_ptr<bip::mapped_region>> MapAll(int fd, uint64_t bytes,
                                                          absl::string_view what) {
  try {
    return std::make_unique<bip::mapped_region>(FdMappable{fd}, bip::read_write, 0,
                                                static_cast<size_t>(bytes));
  } catch (const bip::interprocess_exception& e) {
    if (e.get_native_error() != 0) {
      return ErrnoStatus(e.get_native_error(), absl::StrCat("map ", what));
    }
    return absl::InternalError(absl::StrCat("shm: cannot map ", what, ": ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("shm: cannot map ", what, ": ", e.what()));
  }
}

}  // namespace

struct ShmSegment::Mapping {
  std::unique_ptr<bip::mapped_region> region;
};

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(absl::string_view label,
                                                               uint64_t bytes,
                                                               const CreateOptions& options) {
  const std::string l(label.substr(0, 200));
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm: cannot create ", l, " with 0 bytes; a segment needs a size"));
  }
  if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm: cannot create ", l, " with ", bytes, " bytes: larger than off_t"));
  }
  UniqueFd fd(::memfd_create(l.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("create memfd ", l));
  const std::string what = absl::StrCat(l, " (", bytes, " bytes)");
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus(errno, absl::StrCat("size ", what));
  }
  if (options.reserve) {
    int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes));
    if (err != 0) return ErrnoStatus(err, absl::StrCat("reserve ", what));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, kRequiredSeals) != 0) {
    return ErrnoStatus(errno, absl::StrCat("seal ", what));
  }
  absl::StatusOr<std::unique_ptr<bip::mapped_region>> region = MapAll(fd.get(), bytes, what);
  if (!region.ok()) return region.status();
  auto mapping = std::make_unique<Mapping>(Mapping{*std::move(region)});
  return std::unique_ptr<ShmSegment>(new ShmSegment(l, std::move(fd), std::move(mapping)));
}

absl::Status ShmSegment::CheckSealed(int fd, absl::string_view what) {
  const std::string w(what);
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", w));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: ", w, " is not a memory file descriptor; pass a sealed memfd (memfd_create with "
        "MFD_ALLOW_SEALING, then F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)"));
  }
  struct statfs fs;
  if (::fstatfs(fd, &fs) != 0) return ErrnoStatus(errno, absl::StrCat("statfs ", w));
  if (fs.f_type != TMPFS_MAGIC) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: ", w, " is not a memfd (filesystem type 0x", absl::Hex(fs.f_type),
        "; hugetlbfs and files are refused); pass a sealed memfd from memfd_create"));
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm: ", w, " does not support sealing (", std::strerror(errno),
        "); create it with memfd_create(..., MFD_ALLOW_SEALING) and seal it"));
  }
  auto missing = [&](absl::string_view name) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm: ", w, " is not sealed with ", name, "; seal it (fcntl F_ADD_SEALS, F_SEAL_SHRINK | "
        "F_SEAL_GROW | F_SEAL_SEAL) before passing it: dosd maps only memory its owner cannot "
        "resize"));
  };
  if ((seals & F_SEAL_SHRINK) == 0) return missing("F_SEAL_SHRINK");
  if ((seals & F_SEAL_GROW) == 0) return missing("F_SEAL_GROW");
  if ((seals & F_SEAL_SEAL) == 0) return missing("F_SEAL_SEAL");
  if (const int mode = ::fcntl(fd, F_GETFL); mode >= 0 && (mode & O_ACCMODE) == O_RDONLY) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm: ", w,
        " is open read-only; dosd maps it for reading and writing: pass the "
        "descriptor memfd_create returned (or one opened O_RDWR), not a read-only one such as "
        "dosd's state view"));
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm: ", w, " is sealed against writes; dosd needs to write into it"));
  }
  if (st.st_size <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm: ", w, " has size 0; size it before sealing"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ShmSegment::SealedSize(int fd, absl::string_view what) {
  if (absl::Status s = CheckSealed(fd, what); !s.ok()) return s;
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", what));
  return static_cast<uint64_t>(st.st_size);
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Adopt(UniqueFd fd, absl::string_view what) {
  if (!fd.valid()) {
    return absl::InvalidArgumentError(absl::StrCat("shm: ", what, ": no descriptor"));
  }
  if (absl::Status s = CheckSealed(fd.get(), what); !s.ok()) return s;
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", what));
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  const std::string w = absl::StrCat(what, " (", bytes, " bytes)");
  absl::StatusOr<std::unique_ptr<bip::mapped_region>> region = MapAll(fd.get(), bytes, w);
  if (!region.ok()) return region.status();
  auto mapping = std::make_unique<Mapping>(Mapping{*std::move(region)});
  // The mapping keeps the memory; the descriptor itself is not needed (and
  // would count against the open-file limit per segment).
  fd.reset();
  return std::unique_ptr<ShmSegment>(
      new ShmSegment(std::string(what), std::move(fd), std::move(mapping)));
}

ShmSegment::ShmSegment(std::string label, UniqueFd fd, std::unique_ptr<Mapping> mapping)
    : label_(std::move(label)),
      fd_(std::move(fd)),
      mapping_(std::move(mapping)),
      data_(mapping_->region->get_address()),
      size_(mapping_->region->get_size()) {}

ShmSegment::~ShmSegment() {
  mapping_.reset();
  if (on_unmap_) on_unmap_();
}

}  // namespace dos
