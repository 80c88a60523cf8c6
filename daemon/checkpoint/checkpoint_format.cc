#include "daemon/checkpoint/checkpoint_format.h"

#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace dos {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint format is little-endian and so is every host we build for");

namespace {

void AppendU32(std::string* out, uint32_t v) {
  char b[4];
  PutU32(b, v);
  out->append(b, 4);
}
void AppendU64(std::string* out, uint64_t v) {
  char b[8];
  PutU64(b, v);
  out->append(b, 8);
}
void AppendF64(std::string* out, double v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  AppendU64(out, u);
}
void AppendString(std::string* out, absl::string_view s) {
  AppendU32(out, static_cast<uint32_t>(s.size()));
  out->append(s.data(), s.size());
}

// Bounds-checked reader over the layout block. The first failure sticks;
// its message names the field and the offset within the block.
class Decoder {
 public:
  explicit Decoder(absl::string_view bytes) : bytes_(bytes) {}

  bool U32(absl::string_view field, uint32_t* v) {
    if (!Need(field, 4)) return false;
    *v = GetU32(bytes_.data() + pos_);
    pos_ += 4;
    return true;
  }
  bool U64(absl::string_view field, uint64_t* v) {
    if (!Need(field, 8)) return false;
    *v = GetU64(bytes_.data() + pos_);
    pos_ += 8;
    return true;
  }
  bool F64(absl::string_view field, double* v) {
    uint64_t u;
    if (!U64(field, &u)) return false;
    std::memcpy(v, &u, 8);
    return true;
  }
  bool String(absl::string_view field, std::string* s) {
    uint32_t n;
    if (!U32(field, &n)) return false;
    if (n > kMaxNameBytes) {
      return Fail(field, absl::StrCat("length ", n, " exceeds the limit of ", kMaxNameBytes));
    }
    if (!Need(field, n)) return false;
    s->assign(bytes_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool Fail(absl::string_view field, absl::string_view what) {
    if (error_.empty()) error_ = absl::StrCat(field, " at layout offset ", pos_, ": ", what);
    return false;
  }
  size_t remaining() const { return bytes_.size() - pos_; }
  size_t pos() const { return pos_; }
  const std::string& error() const { return error_; }

 private:
  bool Need(absl::string_view field, size_t n) {
    if (remaining() < n) {
      return Fail(field, absl::StrCat("needs ", n, " bytes, the layout block has ", remaining(),
                                      " left"));
    }
    return true;
  }

  absl::string_view bytes_;
  size_t pos_ = 0;
  std::string error_;
};

// Smallest encodings, used to bound counts before allocating for them.
constexpr size_t kGroupRecordBytes = 5 * 8 + 4;
constexpr size_t kMinTensorRecordBytes = 4 + 4 + 4 + 8 + 4 + 8;

}  // namespace

absl::string_view StateArrayName(StateArray a) {
  switch (a) {
    case StateArray::kMaster:
      return "master";
    case StateArray::kExpAvg:
      return "exp_avg";
    case StateArray::kExpAvgSq:
      return "exp_avg_sq";
  }
  return "unknown";
}

uint64_t CheckpointLayout::total_params() const {
  uint64_t n = 0;
  for (const TensorDesc& t : tensors) n += t.numel;
  return n;
}

void PutU32(char* p, uint32_t v) { std::memcpy(p, &v, 4); }
void PutU64(char* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t GetU32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

std::string EncodeLayout(const CheckpointLayout& layout) {
  std::string out;
  AppendU64(&out, layout.subgroup_size);
  AppendString(&out, layout.owner);
  AppendU32(&out, static_cast<uint32_t>(layout.rank));
  AppendU32(&out, static_cast<uint32_t>(layout.world_size));
  AppendU32(&out, static_cast<uint32_t>(layout.groups.size()));
  for (const GroupConfig& g : layout.groups) {
    AppendF64(&out, g.defaults.lr);
    AppendF64(&out, g.defaults.beta1);
    AppendF64(&out, g.defaults.beta2);
    AppendF64(&out, g.defaults.eps);
    AppendF64(&out, g.defaults.weight_decay);
    AppendU32(&out, g.decoupled_weight_decay ? 1 : 0);
  }
  AppendU32(&out, static_cast<uint32_t>(layout.tensors.size()));
  for (const TensorDesc& t : layout.tensors) {
    AppendString(&out, t.name);
    AppendU32(&out, static_cast<uint32_t>(t.param_dtype));
    AppendU32(&out, static_cast<uint32_t>(t.grad_dtype));
    AppendU64(&out, t.numel);
    AppendU32(&out, t.group);
    AppendU64(&out, static_cast<uint64_t>(t.step));
  }
  if (FileVersion(layout) >= 2) AppendU32(&out, static_cast<uint32_t>(layout.state_format));
  return out;
}

absl::StatusOr<CheckpointLayout> DecodeLayout(absl::string_view bytes, uint32_t version) {
  Decoder d(bytes);
  CheckpointLayout l;
  uint32_t rank = 0, world = 0, num_groups = 0, num_tensors = 0;
  bool ok = d.U64("subgroup_size", &l.subgroup_size) && d.String("owner", &l.owner) &&
            d.U32("rank", &rank) && d.U32("world_size", &world) &&
            d.U32("num_groups", &num_groups);
  if (ok && l.subgroup_size == 0) ok = d.Fail("subgroup_size", "is 0");
  if (ok && num_groups > d.remaining() / kGroupRecordBytes) {
    ok = d.Fail("num_groups", absl::StrCat(num_groups, " groups cannot fit in ", d.remaining(),
                                           " bytes"));
  }
  l.rank = static_cast<int32_t>(rank);
  l.world_size = static_cast<int32_t>(world);
  for (uint32_t i = 0; ok && i < num_groups; ++i) {
    GroupConfig g;
    uint32_t decoupled = 0;
    std::string f = absl::StrCat("groups[", i, "]");
    ok = d.F64(f + ".lr", &g.defaults.lr) && d.F64(f + ".beta1", &g.defaults.beta1) &&
         d.F64(f + ".beta2", &g.defaults.beta2) && d.F64(f + ".eps", &g.defaults.eps) &&
         d.F64(f + ".weight_decay", &g.defaults.weight_decay) &&
         d.U32(f + ".decoupled_weight_decay", &decoupled);
    if (ok && decoupled > 1) ok = d.Fail(f + ".decoupled_weight_decay", "is not 0 or 1");
    g.decoupled_weight_decay = decoupled == 1;
    l.groups.push_back(g);
  }
  if (ok) ok = d.U32("num_tensors", &num_tensors);
  if (ok && num_tensors > d.remaining() / kMinTensorRecordBytes) {
    ok = d.Fail("num_tensors", absl::StrCat(num_tensors, " tensors cannot fit in ",
                                            d.remaining(), " bytes"));
  }
  uint64_t total = 0;
  for (uint32_t i = 0; ok && i < num_tensors; ++i) {
    TensorDesc t;
    uint32_t pd = 0, gd = 0;
    uint64_t step = 0;
    std::string f = absl::StrCat("tensors[", i, "]");
    ok = d.String(f + ".name", &t.name) && d.U32(f + ".param_dtype", &pd) &&
         d.U32(f + ".grad_dtype", &gd) && d.U64(f + ".numel", &t.numel) &&
         d.U32(f + ".group", &t.group) && d.U64(f + ".step", &step);
    if (!ok) break;
    if (!IsValidDType(pd)) ok = d.Fail(f + ".param_dtype", absl::StrCat(pd, " is not a dtype"));
    else if (!IsValidDType(gd)) ok = d.Fail(f + ".grad_dtype", absl::StrCat(gd, " is not a dtype"));
    else if (t.group >= num_groups) {
      ok = d.Fail(f + ".group", absl::StrCat(t.group, " is out of range; the layout has ",
                                             num_groups, " groups"));
    } else if (t.numel > kMaxCheckpointParams - total) {
      ok = d.Fail(f + ".numel", absl::StrCat(t.numel, " takes the shard past ",
                                             kMaxCheckpointParams, " parameters"));
    }
    total += t.numel;
    t.param_dtype = static_cast<DType>(pd);
    t.grad_dtype = static_cast<DType>(gd);
    t.step = static_cast<int64_t>(step);
    l.tensors.push_back(std::move(t));
  }
  if (ok && version >= 2) {
    uint32_t format = 0;
    ok = d.U32("state_format", &format);
    if (ok && !IsValidStateFormat(format)) {
      ok = d.Fail("state_format", absl::StrCat(format, " is not 0 (fp32) or 1 (compact)"));
    }
    l.state_format = static_cast<StateFormat>(format);
  }
  if (ok && d.remaining() != 0) {
    ok = d.Fail("end", absl::StrCat(d.remaining(), " unexpected bytes after the last tensor"));
  }
  if (!ok) return absl::DataLossError(d.error());
  return l;
}

absl::Status ValidateLayout(const CheckpointLayout& l) {
  if (l.subgroup_size == 0) return absl::InvalidArgumentError("layout: subgroup_size is 0");
  if (l.owner.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: owner is ", l.owner.size(), " bytes; the limit is ", kMaxNameBytes));
  }
  uint64_t total = 0;
  for (size_t i = 0; i < l.tensors.size(); ++i) {
    const TensorDesc& t = l.tensors[i];
    std::string f = absl::StrCat("layout: tensors[", i, "]");
    if (t.name.size() > kMaxNameBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(f, ".name is ", t.name.size(), " bytes; the limit is ", kMaxNameBytes));
    }
    if (!IsValidDType(static_cast<uint32_t>(t.param_dtype)) ||
        !IsValidDType(static_cast<uint32_t>(t.grad_dtype))) {
      return absl::InvalidArgumentError(absl::StrCat(f, " has an invalid dtype"));
    }
    if (t.group >= l.groups.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(f, ".group is ", t.group, "; the layout has ", l.groups.size(), " groups"));
    }
    if (t.numel > kMaxCheckpointParams - total) {
      return absl::InvalidArgumentError(
          absl::StrCat(f, ".numel takes the shard past ", kMaxCheckpointParams, " parameters"));
    }
    total += t.numel;
  }
  return absl::OkStatus();
}

uint64_t ExpectedFileSize(const CheckpointLayout& layout, uint64_t layout_bytes,
                          uint32_t chunk_bytes) {
  uint64_t size = kFileHeaderBytes + layout_bytes + kTrailerBytes;
  for (const TensorDesc& t : layout.tensors) {
    for (uint32_t a = 0; a < kNumStateArrays; ++a) {
      const uint64_t elem = ElementBytes(layout, static_cast<StateArray>(a));
      const uint64_t chunk_elems = chunk_bytes / elem;
      const uint64_t chunks = (t.numel + chunk_elems - 1) / chunk_elems;
      size += kSectionHeaderBytes + t.numel * elem + chunks * kChunkCrcBytes;
    }
  }
  return size;
}

}  // namespace dos
