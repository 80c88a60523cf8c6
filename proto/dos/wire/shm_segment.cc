#include "dos/wire/shm_segment.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "boost/interprocess/exceptions.hpp"
#include "boost/interprocess/mapped_region.hpp"
#include "boost/interprocess/permissions.hpp"
#include "boost/interprocess/shared_memory_object.hpp"

namespace dos {
namespace {

namespace bip = boost::interprocess;

// What an operator can do about `err`; empty if nothing specific.
absl::string_view Hint(int err) {
  switch (err) {
    case EEXIST:
      return "another segment has this name; if its owner died, remove it from /dev/shm";
    case ENOENT:
      return "no segment has this name: its owner has not created it yet or already removed it";
    case EACCES:
    case EPERM:
      return "the segment's owner or mode does not admit this user; run as its owner or a member "
             "of its group";
    case ENOSPC:
    case ENOMEM:
    case EFBIG:
      return "free space in /dev/shm (df -h /dev/shm) or lower the buffer sizes";
    case EMFILE:
    case ENFILE:
      return "too many open files; raise the limit (ulimit -n, LimitNOFILE=)";
    default:
      return {};
  }
}

absl::StatusCode CodeFor(int err) {
  switch (err) {
    case EEXIST:
      return absl::StatusCode::kAlreadyExists;
    case ENOENT:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
      return absl::StatusCode::kPermissionDenied;
    case ENOSPC:
    case ENOMEM:
    case EFBIG:
    case EMFILE:
    case ENFILE:
      return absl::StatusCode::kResourceExhausted;
    case EINVAL:
    case ENAMETOOLONG:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

// "shm: cannot <what>: <strerror>; <hint>"
absl::Status ErrnoStatus(int err, absl::string_view what) {
  std::string message = absl::StrCat("shm: cannot ", what, ": ", std::strerror(err));
  absl::string_view hint = Hint(err);
  if (!hint.empty()) absl::StrAppend(&message, "; ", hint);
  return absl::Status(CodeFor(err), message);
}

absl::Status ExceptionStatus(const bip::interprocess_exception& e, absl::string_view what) {
  int err = e.get_native_error();
  if (err != 0) return ErrnoStatus(err, what);
  return absl::InternalError(absl::StrCat("shm: cannot ", what, ": ", e.what()));
}

}  // namespace

struct ShmSegment::Mapping {
  bip::mapped_region region;
};

absl::Status ShmSegment::ValidateName(std::string_view name) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("shm: bad segment name \"",
                                                   absl::string_view(name.data(), name.size()),
                                                   "\": ", why, " (e.g. \"/dos.12.ctl\")"));
  };
  if (name.empty() || name[0] != '/') return bad("must start with '/'");
  if (name.size() == 1 || name == "/." || name == "/..") return bad("needs a name after '/'");
  if (name.size() > kMaxNameLength) {
    return bad(absl::StrCat("longer than ", kMaxNameLength, " characters"));
  }
  if (name.find('/', 1) != std::string_view::npos)
    return bad("must not contain '/' after the first");
  if (name.find('\0') != std::string_view::npos) return bad("must not contain NUL");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(std::string_view name,
                                                               uint64_t bytes,
                                                               const CreateOptions& options) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  const std::string n(name);
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm: cannot create ", n, " with 0 bytes; a segment needs a size"));
  }
  if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm: cannot create ", n, " with ", bytes, " bytes: larger than off_t"));
  }
  bool created = false;
  // Anything after creation that fails removes the name again, so a failed
  // Create leaves no half-made object behind.
  auto fail = [&](absl::Status s) {
    if (created) bip::shared_memory_object::remove(n.c_str());
    return s;
  };
  std::string what = absl::StrCat("create ", n);
  try {
    bip::shared_memory_object shm(bip::create_only, n.c_str(), bip::read_write,
                                  bip::permissions(static_cast<int>(options.mode)));
    created = true;
    what = absl::StrCat("size ", n, " to ", bytes, " bytes");
    shm.truncate(static_cast<bip::offset_t>(bytes));
    if (options.reserve) {
      int err = posix_fallocate(shm.get_mapping_handle().handle, 0, static_cast<off_t>(bytes));
      if (err != 0) return fail(ErrnoStatus(err, what));
    }
    what = absl::StrCat("map ", n, " (", bytes, " bytes)");
    auto mapping = std::make_unique<Mapping>(
        Mapping{bip::mapped_region(shm, bip::read_write, 0, static_cast<size_t>(bytes))});
    return std::unique_ptr<ShmSegment>(
        new ShmSegment(n, std::move(mapping), options.unlink_on_destroy));
  } catch (const bip::interprocess_exception& e) {
    return fail(ExceptionStatus(e, what));
  } catch (const std::exception& e) {
    return fail(absl::InternalError(absl::StrCat("shm: cannot ", what, ": ", e.what())));
  }
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Open(std::string_view name) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  const std::string n(name);
  std::string what = absl::StrCat("open ", n);
  try {
    bip::shared_memory_object shm(bip::open_only, n.c_str(), bip::read_write);
    bip::offset_t size = 0;
    if (!shm.get_size(size)) return ErrnoStatus(errno, absl::StrCat("stat ", n));
    if (size <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shm: cannot open ", n, ": it has size 0; its creator has not sized it yet or failed"));
    }
    what = absl::StrCat("map ", n, " (", size, " bytes)");
    auto mapping = std::make_unique<Mapping>(
        Mapping{bip::mapped_region(shm, bip::read_write, 0, static_cast<size_t>(size))});
    return std::unique_ptr<ShmSegment>(
        new ShmSegment(n, std::move(mapping), /*unlink_on_destroy=*/false));
  } catch (const bip::interprocess_exception& e) {
    return ExceptionStatus(e, what);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("shm: cannot ", what, ": ", e.what()));
  }
}

ShmSegment::ShmSegment(std::string name, std::unique_ptr<Mapping> mapping, bool unlink_on_destroy)
    : name_(std::move(name)),
      mapping_(std::move(mapping)),
      data_(mapping_->region.get_address()),
      size_(mapping_->region.get_size()),
      unlink_on_destroy_(unlink_on_destroy) {}

ShmSegment::~ShmSegment() {
  if (unlink_on_destroy_) Unlink();
}

void ShmSegment::Unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  // remove() reports failure (e.g. a peer already unlinked it) by returning
  // false and never throws; either way the name is gone.
  bip::shared_memory_object::remove(name_.c_str());
}

}  // namespace dos
