#include "daemon/checkpoint/checkpoint_writer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "daemon/checkpoint/crc32c.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

// Distinguishes the temporary files of concurrent writers in one process.
std::atomic<uint64_t> temp_counter{0};

uint32_t ChunkCrc(const char* data, size_t n, uint64_t file_offset) {
  char off[8];
  PutU64(off, file_offset);
  return crc32c::Extend(crc32c::Value(data, n), off, sizeof off);
}

}  // namespace

CheckpointWriter::CheckpointWriter(std::string path, CheckpointLayout layout, Env* env,
                                   const CheckpointWriterOptions& options)
    : path_(std::move(path)), layout_(std::move(layout)), env_(env), options_(options) {}

absl::StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Create(
    const std::string& path, CheckpointLayout layout, Env* env,
    const CheckpointWriterOptions& options) {
  if (path.empty() || path.back() == '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint path '", path, "' must name a file"));
  }
  if (options.chunk_bytes < kMinChunkBytes || options.chunk_bytes > kMaxChunkBytes ||
      options.chunk_bytes % sizeof(float) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint chunk_bytes ", options.chunk_bytes, " must be a multiple of 4 in [",
        kMinChunkBytes, ", ", kMaxChunkBytes, "]"));
  }
  DOS_RETURN_IF_ERROR(ValidateLayout(layout));
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter(path, std::move(layout), env, options));
  DOS_RETURN_IF_ERROR(w->Start());
  return w;
}

CheckpointWriter::~CheckpointWriter() {
  if (!committed_) Abandon();
}

absl::Status CheckpointWriter::Start() {
  const std::string layout_bytes = EncodeLayout(layout_);
  expected_bytes_ = ExpectedFileSize(layout_, layout_bytes.size(), options_.chunk_bytes);
  const std::string dir = DirName(path_);
  if (options_.check_free_space) {
    absl::StatusOr<uint64_t> free = env_->FreeBytes(dir);
    // The old checkpoint is replaced only after the new one is complete, so
    // both must fit at once.
    if (free.ok() && *free < expected_bytes_) {
      error_ = absl::ResourceExhaustedError(absl::StrCat(
          "checkpoint ", path_, " needs ", expected_bytes_, " bytes but only ", *free,
          " bytes are free on ", dir, "; nothing was written and the previous checkpoint is "
          "intact; free space or choose another checkpoint directory"));
      return error_;
    }
  }
  // The Env creates the temporary exclusively and never through a link: a
  // name someone planted (a file or a symlink) is skipped for the next one.
  absl::StatusOr<std::unique_ptr<WritableFile>> f;
  for (int attempt = 0; attempt < 64; ++attempt) {
    temp_path_ = absl::StrCat(path_, ".tmp.", ::getpid(), ".", temp_counter.fetch_add(1));
    f = env_->NewWritableFile(temp_path_, options_.file_mode);
    if (!absl::IsAlreadyExists(f.status())) break;
  }
  if (!f.ok()) {
    error_ = absl::Status(f.status().code(),
                          absl::StrCat("checkpoint ", path_, ": ", f.status().message()));
    return error_;
  }
  file_ = std::move(*f);
  temp_live_ = true;
  chunk_.resize(options_.chunk_bytes + kChunkCrcBytes);

  char header[kFileHeaderBytes] = {};
  std::memcpy(header, kCheckpointMagic, 8);
  PutU32(header + 8, FileVersion(layout_));
  PutU32(header + 12, static_cast<uint32_t>(kFileHeaderBytes));
  PutU64(header + 16, layout_bytes.size());
  PutU32(header + 24, crc32c::Value(layout_bytes.data(), layout_bytes.size()));
  PutU32(header + 28, options_.chunk_bytes);
  uint64_t created = options_.created_unix_seconds != 0
                         ? options_.created_unix_seconds
                         : static_cast<uint64_t>(std::time(nullptr));
  PutU64(header + 32, created);
  PutU32(header + 44, crc32c::Value(header, 44));
  DOS_RETURN_IF_ERROR(WriteAll(header, sizeof header));
  return WriteAll(layout_bytes.data(), layout_bytes.size());
}

absl::Status CheckpointWriter::WriteAll(const char* data, size_t n) {
  if (!error_.ok()) return error_;
  while (n > 0) {
    absl::StatusOr<size_t> w = file_->Write(data, n);
    if (!w.ok()) {
      std::string msg = absl::StrCat("checkpoint ", path_, ": writing ", temp_path_,
                                     " failed after ", bytes_written_, " of ", expected_bytes_,
                                     " bytes: ", w.status().message());
      rlimit fsize{};
      if (absl::IsResourceExhausted(w.status()) && ::getrlimit(RLIMIT_FSIZE, &fsize) == 0 &&
          fsize.rlim_cur != RLIM_INFINITY && bytes_written_ + n > fsize.rlim_cur) {
        absl::StrAppend(&msg, " (dosd's file size limit, RLIMIT_FSIZE, is ", fsize.rlim_cur,
                        " bytes: below the checkpoint's ", expected_bytes_, "); the previous "
                        "checkpoint is intact; raise the limit for dosd (systemd LimitFSIZE=, "
                        "ulimit -f)");
      } else if (absl::IsResourceExhausted(w.status())) {
        absl::StatusOr<uint64_t> free = env_->FreeBytes(DirName(path_));
        absl::StrAppend(&msg, " (", free.ok() ? absl::StrCat(*free) : std::string("unknown"),
                        " bytes free on ", DirName(path_),
                        "); the previous checkpoint is intact; free space or choose another "
                        "checkpoint directory");
      } else {
        absl::StrAppend(&msg, "; the previous checkpoint is intact");
      }
      return Fail(absl::Status(w.status().code(), msg));
    }
    if (*w == 0 || *w > n) {
      return Fail(absl::InternalError(absl::StrCat(
          "checkpoint ", path_, ": the file system accepted ", *w, " of ", n, " bytes written to ",
          temp_path_, " after ", bytes_written_, " bytes; the previous checkpoint is intact")));
    }
    data += *w;
    n -= *w;
    bytes_written_ += *w;
  }
  return absl::OkStatus();
}

absl::Status CheckpointWriter::BeginSection(uint32_t tensor, StateArray which) {
  if (!error_.ok()) return error_;
  const uint64_t section = uint64_t{tensor} * kNumStateArrays + static_cast<uint32_t>(which);
  if (in_section_ || section != next_section_ || tensor >= layout_.tensors.size()) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", path_, ": section tensors[", tensor, "].", StateArrayName(which),
        " is out of order; the next section is number ", next_section_, " of ",
        layout_.tensors.size() * kNumStateArrays)));
  }
  char h[kSectionHeaderBytes] = {};
  PutU32(h, kSectionTag);
  PutU32(h + 4, tensor);
  PutU32(h + 8, static_cast<uint32_t>(which));
  PutU64(h + 16, layout_.tensors[tensor].numel);
  PutU32(h + 28, crc32c::Value(h, 28));
  in_section_ = true;
  section_elems_ = 0;
  chunk_fill_ = 0;
  return WriteAll(h, sizeof h);
}

absl::Status CheckpointWriter::Append(const float* values, size_t n) {
  return AppendBytes(values, n, sizeof(float));
}

absl::Status CheckpointWriter::AppendBf16(const uint16_t* values, size_t n) {
  return AppendBytes(values, n, sizeof(uint16_t));
}

absl::Status CheckpointWriter::AppendBytes(const void* values, size_t n, uint64_t elem_bytes) {
  if (!error_.ok()) return error_;
  if (!in_section_) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path_, ": values appended with no section open")));
  }
  const StateArray which = static_cast<StateArray>(next_section_ % kNumStateArrays);
  if (ElementBytes(layout_, which) != elem_bytes) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", path_, ": ", elem_bytes == 2 ? "bf16" : "fp32", " values appended to ",
        StateArrayName(which), ", which a ", StateFormatName(layout_.state_format),
        " checkpoint stores as ", ElementBytes(layout_, which) == 2 ? "bf16" : "fp32")));
  }
  const TensorDesc& t = layout_.tensors[next_section_ / kNumStateArrays];
  if (n > t.numel - section_elems_) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path_, ": ", n, " values appended to tensor '", t.name,
                     "' which has ", t.numel - section_elems_, " left")));
  }
  const char* src = static_cast<const char*>(values);
  size_t bytes = n * elem_bytes;
  while (bytes > 0) {
    size_t take = std::min<size_t>(bytes, options_.chunk_bytes - chunk_fill_);
    std::memcpy(chunk_.data() + chunk_fill_, src, take);
    chunk_fill_ += take;
    src += take;
    bytes -= take;
    if (chunk_fill_ == options_.chunk_bytes) DOS_RETURN_IF_ERROR(FlushChunk());
  }
  section_elems_ += n;
  return absl::OkStatus();
}

absl::Status CheckpointWriter::FlushChunk() {
  if (chunk_fill_ == 0) return absl::OkStatus();
  PutU32(chunk_.data() + chunk_fill_, ChunkCrc(chunk_.data(), chunk_fill_, bytes_written_));
  size_t n = chunk_fill_ + kChunkCrcBytes;
  chunk_fill_ = 0;
  return WriteAll(chunk_.data(), n);
}

absl::Status CheckpointWriter::EndSection() {
  if (!error_.ok()) return error_;
  if (!in_section_) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path_, ": EndSection with no section open")));
  }
  const TensorDesc& t = layout_.tensors[next_section_ / kNumStateArrays];
  if (section_elems_ != t.numel) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path_, ": section of tensor '", t.name, "' ended after ",
                     section_elems_, " of ", t.numel, " values")));
  }
  DOS_RETURN_IF_ERROR(FlushChunk());
  in_section_ = false;
  ++next_section_;
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Commit() {
  if (!error_.ok()) return error_;
  if (committed_) return absl::FailedPreconditionError("checkpoint already committed");
  const uint64_t sections = layout_.tensors.size() * kNumStateArrays;
  if (in_section_ || next_section_ != sections) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path_, ": commit after ", next_section_, " of ", sections,
                     " sections")));
  }
  char trailer[kTrailerBytes] = {};
  std::memcpy(trailer, kCheckpointTrailerMagic, 8);
  PutU64(trailer + 8, sections);
  PutU64(trailer + 16, bytes_written_);
  PutU32(trailer + 28, crc32c::Value(trailer, 28));
  DOS_RETURN_IF_ERROR(WriteAll(trailer, sizeof trailer));
  if (bytes_written_ != expected_bytes_) {
    return Fail(absl::InternalError(absl::StrCat("checkpoint ", path_, ": wrote ", bytes_written_,
                                                 " bytes, the format needs ", expected_bytes_)));
  }
  auto fail = [&](const absl::Status& s, absl::string_view step) {
    return Fail(absl::Status(s.code(), absl::StrCat("checkpoint ", path_, ": ", step, " failed: ",
                                                    s.message(),
                                                    "; the previous checkpoint is intact")));
  };
  if (absl::Status s = file_->Sync(); !s.ok()) return fail(s, "fsync");
  if (absl::Status s = file_->Close(); !s.ok()) return fail(s, "close");
  if (absl::Status s = env_->RenameFile(temp_path_, path_); !s.ok()) return fail(s, "rename");
  committed_ = true;
  file_.reset();
  // The new file is in place; only its durability across a power loss is at
  // stake now, so the temporary file is not deleted (it no longer exists).
  if (absl::Status s = env_->SyncDir(DirName(path_)); !s.ok()) {
    error_ = absl::Status(
        s.code(), absl::StrCat("checkpoint ", path_, " is written but the directory fsync "
                               "failed, so it may not survive a power loss: ", s.message()));
    return error_;
  }
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Fail(absl::Status status) {
  if (error_.ok()) error_ = std::move(status);
  Abandon();
  return error_;
}

void CheckpointWriter::Abandon() {
  if (committed_ || !temp_live_) return;
  if (file_ != nullptr) {
    file_->Close().IgnoreError();
    file_.reset();
  }
  if (env_->FileExists(temp_path_)) env_->DeleteFile(temp_path_).IgnoreError();
  temp_live_ = false;
}

absl::StatusOr<int> RemoveStaleCheckpointTemporaries(const std::string& dir, Env* env) {
  DOS_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(dir));
  const std::string own = absl::StrCat(".tmp.", ::getpid(), ".");
  int removed = 0;
  for (const std::string& name : names) {
    // <name>.tmp.<digits>.<digits>
    size_t tmp = name.rfind(".tmp.");
    if (tmp == std::string::npos || tmp == 0) continue;
    absl::string_view rest = absl::string_view(name).substr(tmp + 5);
    size_t dot = rest.find('.');
    if (dot == absl::string_view::npos || dot == 0 || dot + 1 == rest.size()) continue;
    auto digits = [](absl::string_view v) {
      return std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    if (!digits(rest.substr(0, dot)) || !digits(rest.substr(dot + 1))) continue;
    if (name.compare(tmp, own.size(), own) == 0) continue;  // a writer of this process
    DOS_RETURN_IF_ERROR(env->DeleteFile(absl::StrCat(dir, "/", name)));
    ++removed;
  }
  return removed;
}

}  // namespace dos
