#include "daemon/checkpoint/checkpoint_reader.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/checkpoint/crc32c.h"
#include "dos/wire/status_macros.h"

namespace dos {

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& path,
                                                                         Env* env) {
  absl::StatusOr<std::unique_ptr<ReadableFile>> f = env->NewReadableFile(path);
  if (!f.ok()) {
    return absl::Status(f.status().code(),
                        absl::StrCat("checkpoint ", path, ": ", f.status().message()));
  }
  std::unique_ptr<CheckpointReader> r(new CheckpointReader(path, std::move(*f)));
  DOS_RETURN_IF_ERROR(r->ReadHeaderAndLayout());
  return r;
}

absl::Status CheckpointReader::Corrupt(absl::string_view what, uint64_t offset,
                                       absl::string_view detail) const {
  return absl::DataLossError(absl::StrCat("checkpoint ", path_, " is corrupt: ", what,
                                          " at offset ", offset, ": ", detail,
                                          "; it was not loaded"));
}

absl::Status CheckpointReader::Fail(absl::Status status) {
  if (error_.ok()) error_ = std::move(status);
  return error_;
}

absl::Status CheckpointReader::ReadExact(char* buf, size_t n, absl::string_view what) {
  size_t got = 0;
  while (got < n) {
    absl::StatusOr<size_t> r = file_->Read(buf + got, n - got);
    if (!r.ok()) {
      return Fail(absl::Status(r.status().code(),
                               absl::StrCat("checkpoint ", path_, ": reading ", what,
                                            " at offset ", offset_ + got, ": ",
                                            r.status().message())));
    }
    if (*r == 0) {
      return Fail(absl::DataLossError(absl::StrCat(
          "checkpoint ", path_, " is truncated: ", what, " at offset ", offset_,
          " needs ", n, " bytes, the file ends after ", got, "; it was not loaded")));
    }
    got += *r;
  }
  offset_ += n;
  return absl::OkStatus();
}

absl::Status CheckpointReader::ReadHeaderAndLayout() {
  file_bytes_ = file_->Size();
  if (file_bytes_ < kFileHeaderBytes) {
    return Fail(absl::DataLossError(absl::StrCat(
        "checkpoint ", path_, " is truncated: ", file_bytes_, " bytes, shorter than the ",
        kFileHeaderBytes, "-byte header; it was not loaded")));
  }
  char h[kFileHeaderBytes];
  DOS_RETURN_IF_ERROR(ReadExact(h, sizeof h, "header"));
  if (std::memcmp(h, kCheckpointMagic, 8) != 0) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat(path_, " is not a DOS checkpoint (bad magic)")));
  }
  if (uint32_t crc = crc32c::Value(h, 44); crc != GetU32(h + 44)) {
    return Fail(Corrupt("header", 0,
                        absl::StrFormat("checksum mismatch (stored %08x, computed %08x)",
                                        GetU32(h + 44), crc)));
  }
  const uint32_t version = GetU32(h + 8);
  if (version < kCheckpointVersionNoFormat || version > kCheckpointVersion) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", path_, " has format version ", version, "; this dosd reads versions ",
        kCheckpointVersionNoFormat, " to ", kCheckpointVersion)));
  }
  if (GetU32(h + 12) != kFileHeaderBytes) {
    return Fail(Corrupt("header", 12, absl::StrCat("header size ", GetU32(h + 12))));
  }
  const uint64_t layout_bytes = GetU64(h + 16);
  const uint32_t layout_crc = GetU32(h + 24);
  chunk_bytes_ = GetU32(h + 28);
  created_ = GetU64(h + 32);
  if (chunk_bytes_ < kMinChunkBytes || chunk_bytes_ > kMaxChunkBytes ||
      chunk_bytes_ % sizeof(float) != 0) {
    return Fail(Corrupt("header", 28, absl::StrCat("chunk size ", chunk_bytes_)));
  }
  if (layout_bytes > kMaxLayoutBytes || layout_bytes > file_bytes_ - kFileHeaderBytes) {
    return Fail(absl::DataLossError(absl::StrCat(
        "checkpoint ", path_, " is truncated or corrupt: its layout claims ", layout_bytes,
        " bytes, the file has ", file_bytes_ - kFileHeaderBytes, " after the header; it was not "
        "loaded")));
  }
  std::string layout(layout_bytes, '\0');
  DOS_RETURN_IF_ERROR(ReadExact(layout.data(), layout.size(), "layout"));
  if (uint32_t crc = crc32c::Value(layout.data(), layout.size()); crc != layout_crc) {
    return Fail(Corrupt("layout", kFileHeaderBytes,
                        absl::StrFormat("checksum mismatch (stored %08x, computed %08x)",
                                        layout_crc, crc)));
  }
  absl::StatusOr<CheckpointLayout> l = DecodeLayout(layout, version);
  if (!l.ok()) return Fail(Corrupt("layout", kFileHeaderBytes, l.status().message()));
  layout_ = std::move(*l);
  const uint64_t expected = ExpectedFileSize(layout_, layout_bytes, chunk_bytes_);
  if (file_bytes_ != expected) {
    return Fail(absl::DataLossError(absl::StrCat(
        "checkpoint ", path_, file_bytes_ < expected ? " is truncated" : " has trailing bytes",
        ": ", file_bytes_, " bytes, its layout (", layout_.tensors.size(), " tensors, ",
        layout_.total_params(), " parameters) needs ", expected, "; it was not loaded")));
  }
  uint64_t largest = 0;
  for (const TensorDesc& t : layout_.tensors) largest = std::max(largest, t.numel);
  const uint64_t smallest_elem = MomentBytes(layout_.state_format);
  chunk_.resize(std::min<uint64_t>(largest, chunk_bytes_ / smallest_elem));
  raw_.resize(chunk_.size() * sizeof(float));
  return absl::OkStatus();
}

absl::Status CheckpointReader::ReadSection(uint32_t tensor, StateArray which, Sink sink) {
  if (!error_.ok()) return error_;
  const uint64_t section = uint64_t{tensor} * kNumStateArrays + static_cast<uint32_t>(which);
  if (tensor >= layout_.tensors.size() || section != next_section_) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", path_, ": section tensors[", tensor, "].", StateArrayName(which),
        " asked for out of order; the next is number ", next_section_, " of ",
        layout_.tensors.size() * kNumStateArrays)));
  }
  const TensorDesc& t = layout_.tensors[tensor];
  const std::string what = absl::StrCat("section tensors[", tensor, "] '", t.name, "'.",
                                        StateArrayName(which));
  const uint64_t header_offset = offset_;
  char h[kSectionHeaderBytes];
  DOS_RETURN_IF_ERROR(ReadExact(h, sizeof h, what));
  if (uint32_t crc = crc32c::Value(h, 28); crc != GetU32(h + 28)) {
    return Fail(Corrupt(what, header_offset,
                        absl::StrFormat("header checksum mismatch (stored %08x, computed %08x)",
                                        GetU32(h + 28), crc)));
  }
  if (GetU32(h) != kSectionTag || GetU32(h + 4) != tensor ||
      GetU32(h + 8) != static_cast<uint32_t>(which) || GetU64(h + 16) != t.numel) {
    return Fail(Corrupt(what, header_offset,
                        absl::StrCat("header names tensor ", GetU32(h + 4), " array ",
                                     GetU32(h + 8), " with ", GetU64(h + 16),
                                     " values; expected this section with ", t.numel)));
  }
  const uint64_t elem = ElementBytes(layout_, which);
  const uint64_t chunk_elems = chunk_bytes_ / elem;
  for (uint64_t first = 0; first < t.numel; first += chunk_elems) {
    const size_t n = static_cast<size_t>(std::min(chunk_elems, t.numel - first));
    const uint64_t chunk_offset = offset_;
    char* data = raw_.data();
    DOS_RETURN_IF_ERROR(ReadExact(data, n * elem, what));
    char stored[kChunkCrcBytes];
    DOS_RETURN_IF_ERROR(ReadExact(stored, sizeof stored, what));
    char off[8];
    PutU64(off, chunk_offset);
    uint32_t crc = crc32c::Extend(crc32c::Value(data, n * elem), off, sizeof off);
    if (crc != GetU32(stored)) {
      return Fail(Corrupt(what, chunk_offset,
                          absl::StrFormat("checksum mismatch in the chunk of values %d..%d "
                                          "(stored %08x, computed %08x)",
                                          first, first + n - 1, GetU32(stored), crc)));
    }
    if (elem == sizeof(float)) {
      std::memcpy(chunk_.data(), data, n * sizeof(float));
    } else {
      for (size_t i = 0; i < n; ++i) {
        uint16_t h16;
        std::memcpy(&h16, data + 2 * i, 2);
        chunk_[i] = BF16ToFloat(h16);
      }
    }
    sink(first, chunk_.data(), n);
  }
  ++next_section_;
  return absl::OkStatus();
}

absl::Status CheckpointReader::Finish() {
  if (!error_.ok()) return error_;
  const uint64_t sections = layout_.tensors.size() * kNumStateArrays;
  if (next_section_ != sections) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", path_, ": Finish after ", next_section_, " of ", sections, " sections")));
  }
  const uint64_t trailer_offset = offset_;
  char t[kTrailerBytes];
  DOS_RETURN_IF_ERROR(ReadExact(t, sizeof t, "trailer"));
  if (uint32_t crc = crc32c::Value(t, 28); crc != GetU32(t + 28)) {
    return Fail(Corrupt("trailer", trailer_offset,
                        absl::StrFormat("checksum mismatch (stored %08x, computed %08x)",
                                        GetU32(t + 28), crc)));
  }
  if (std::memcmp(t, kCheckpointTrailerMagic, 8) != 0 || GetU64(t + 8) != sections ||
      GetU64(t + 16) != trailer_offset) {
    return Fail(Corrupt("trailer", trailer_offset,
                        absl::StrCat("it records ", GetU64(t + 8), " sections ending at ",
                                     GetU64(t + 16), "; expected ", sections, " ending at ",
                                     trailer_offset)));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::VerifyAll() {
  auto discard = [](uint64_t, const float*, size_t) {};
  while (error_.ok() && next_section_ < layout_.tensors.size() * kNumStateArrays) {
    DOS_RETURN_IF_ERROR(ReadSection(static_cast<uint32_t>(next_section_ / kNumStateArrays),
                                    static_cast<StateArray>(next_section_ % kNumStateArrays),
                                    discard));
  }
  return Finish();
}

}  // namespace dos
