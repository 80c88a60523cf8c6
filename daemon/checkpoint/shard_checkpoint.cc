#include "daemon/checkpoint/shard_checkpoint.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/checkpoint/checkpoint_reader.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {

// One contiguous run of a tensor's elements inside a subgroup allocation.
struct Run {
  uint64_t tensor_offset;
  uint64_t count;
  const Subgroup* subgroup;
  uint64_t subgroup_offset;
};

// The runs covering `tensor`, in tensor order.
std::vector<Run> RunsOf(const ShardState& shard, uint32_t tensor) {
  std::vector<Run> runs;
  shard.ForEachRun(tensor, [&](const Subgroup& g, const SubgroupSegment& s) {
    runs.push_back({s.tensor_offset, s.count, &g, s.subgroup_offset});
  });
  return runs;
}

// Array `a` of `g` when the subgroup stores it as fp32 (the master always,
// the moments in fp32 format), else null.
float* ArrayOf(const Subgroup& g, StateArray a) {
  switch (a) {
    case StateArray::kMaster:
      return g.master;
    case StateArray::kExpAvg:
      return g.exp_avg;
    case StateArray::kExpAvgSq:
      return g.exp_avg_sq;
  }
  return nullptr;
}

// The same for the bf16 moments of compact format (null otherwise).
uint16_t* Bf16ArrayOf(const Subgroup& g, StateArray a) {
  switch (a) {
    case StateArray::kMaster:
      return nullptr;
    case StateArray::kExpAvg:
      return g.exp_avg_bf16;
    case StateArray::kExpAvgSq:
      return g.exp_avg_sq_bf16;
  }
  return nullptr;
}

absl::Status Mismatch(const LayoutSides& sides, absl::string_view field, const auto& first,
                      const auto& second) {
  return absl::FailedPreconditionError(absl::StrCat(sides.subject, ": ", field, " is ", first, " ",
                                                    sides.first, " but ", second, " ", sides.second,
                                                    "; ", sides.fix));
}

// Reads every section of `reader` into `shard`.
absl::Status ReadInto(CheckpointReader& reader, ShardState* shard) {
  for (uint32_t t = 0; t < shard->tensors().size(); ++t) {
    const std::vector<Run> runs = RunsOf(*shard, t);
    for (uint32_t a = 0; a < kNumStateArrays; ++a) {
      const StateArray which = static_cast<StateArray>(a);
      size_t run = 0;
      // Chunks arrive in order, so one cursor over the runs suffices.
      auto sink = [&](uint64_t first, const float* values, size_t n) {
        while (n > 0) {
          while (first >= runs[run].tensor_offset + runs[run].count) ++run;
          const Run& r = runs[run];
          uint64_t within = first - r.tensor_offset;
          size_t take = static_cast<size_t>(std::min<uint64_t>(n, r.count - within));
          if (float* f = ArrayOf(*r.subgroup, which); f != nullptr) {
            std::memcpy(f + r.subgroup_offset + within, values, take * sizeof(float));
          } else {
            // Compact state: nearest even (exact for values that came from
            // a compact checkpoint, whose bf16 the reader widened).
            uint16_t* h = Bf16ArrayOf(*r.subgroup, which) + r.subgroup_offset + within;
            for (size_t i = 0; i < take; ++i) h[i] = FloatToBF16(values[i]);
          }
          values += take;
          first += take;
          n -= take;
        }
      };
      DOS_RETURN_IF_ERROR(reader.ReadSection(t, which, sink));
    }
  }
  return reader.Finish();
}

}  // namespace

CheckpointLayout LayoutOf(const ShardState& shard, const CheckpointOwner& owner) {
  CheckpointLayout l;
  l.subgroup_size = shard.subgroup_size();
  l.owner = owner.name;
  l.rank = owner.rank;
  l.world_size = owner.world_size;
  l.groups.assign(shard.groups().begin(), shard.groups().end());
  l.state_format = shard.format();
  l.tensors.assign(shard.tensors().begin(), shard.tensors().end());
  return l;
}

absl::Status CheckLayoutMatches(const CheckpointLayout& c, const ShardState& shard,
                                absl::string_view path) {
  return CheckLayoutMatches(
      c, shard,
      LayoutSides{.subject =
                      absl::StrCat("checkpoint ", path, " does not match the session's layout")});
}

absl::Status CheckLayoutMatches(const CheckpointLayout& c, const ShardState& shard,
                                const LayoutSides& sides) {
  std::span<const TensorDesc> tensors = shard.tensors();
  if (c.tensors.size() != tensors.size()) {
    return Mismatch(sides, "the number of tensors", c.tensors.size(), tensors.size());
  }
  if (c.groups.size() != shard.groups().size()) {
    return Mismatch(sides, "the number of param groups", c.groups.size(), shard.groups().size());
  }
  for (size_t i = 0; i < c.groups.size(); ++i) {
    if (c.groups[i].decoupled_weight_decay != shard.groups()[i].decoupled_weight_decay) {
      return Mismatch(sides, absl::StrCat("groups[", i, "].decoupled_weight_decay"),
                      c.groups[i].decoupled_weight_decay ? "true" : "false",
                      shard.groups()[i].decoupled_weight_decay ? "true" : "false");
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorDesc& a = c.tensors[i];
    const TensorDesc& b = tensors[i];
    std::string f = absl::StrCat("tensors[", i, "]");
    if (a.name != b.name) {
      return Mismatch(sides, f + ".name", "'" + a.name + "'", "'" + b.name + "'");
    }
    if (a.numel != b.numel) return Mismatch(sides, f + ".numel", a.numel, b.numel);
    if (a.group != b.group) return Mismatch(sides, f + ".group", a.group, b.group);
    if (a.param_dtype != b.param_dtype) {
      return Mismatch(sides, f + ".param_dtype", DTypeName(a.param_dtype),
                      DTypeName(b.param_dtype));
    }
    if (a.grad_dtype != b.grad_dtype) {
      return Mismatch(sides, f + ".grad_dtype", DTypeName(a.grad_dtype), DTypeName(b.grad_dtype));
    }
  }
  return absl::OkStatus();
}

uint64_t ShardFileBytes(const ShardState& shard, const CheckpointOwner& owner,
                        const CheckpointWriterOptions& options) {
  return LayoutFileBytes(LayoutOf(shard, owner), options);
}

uint64_t LayoutFileBytes(const CheckpointLayout& layout, const CheckpointWriterOptions& options) {
  return ExpectedFileSize(layout, EncodeLayout(layout).size(), options.chunk_bytes);
}

namespace {
// Writes every section of `layout`'s tensors from `shard`, reading each
// subgroup through `acquire(index)`; `release_below(k)` is called once the
// file is past every subgroup below k (a tensor's runs lie in increasing
// subgroups, and tensors in increasing flat order).
template <typename Acquire, typename ReleaseBelow>
absl::Status WriteShard(const CheckpointLayout& layout, const ShardState& shard,
                        const std::string& path, Env* env, const CheckpointWriterOptions& options,
                        Acquire acquire, ReleaseBelow release_below) {
  DOS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> w,
                       CheckpointWriter::Create(path, layout, env, options));
  const Subgroup* first = shard.subgroups().data();
  for (uint32_t t = 0; t < shard.tensors().size(); ++t) {
    const std::vector<Run> runs = RunsOf(shard, t);
    if (!runs.empty()) release_below(static_cast<uint32_t>(runs.front().subgroup - first));
    for (uint32_t a = 0; a < kNumStateArrays; ++a) {
      const StateArray which = static_cast<StateArray>(a);
      DOS_RETURN_IF_ERROR(w->BeginSection(t, which));
      for (const Run& r : runs) {
        const Subgroup& g = acquire(static_cast<uint32_t>(r.subgroup - first));
        if (const float* f = ArrayOf(g, which); f != nullptr) {
          DOS_RETURN_IF_ERROR(w->Append(f + r.subgroup_offset, r.count));
        } else {
          DOS_RETURN_IF_ERROR(w->AppendBf16(Bf16ArrayOf(g, which) + r.subgroup_offset, r.count));
        }
      }
      DOS_RETURN_IF_ERROR(w->EndSection());
    }
  }
  release_below(static_cast<uint32_t>(shard.subgroups().size()));
  return w->Commit();
}
}  // namespace

absl::Status SaveShard(const ShardState& shard, const std::string& path, Env* env,
                       const CheckpointOwner& owner, const CheckpointWriterOptions& options) {
  return WriteShard(
      LayoutOf(shard, owner), shard, path, env, options,
      [&](uint32_t k) -> const Subgroup& { return shard.subgroups()[k]; }, [](uint32_t) {});
}

absl::Status SaveSnapshot(const CheckpointLayout& layout, ShardState& shard,
                          const std::string& path, Env* env,
                          const CheckpointWriterOptions& options) {
  return WriteShard(
      layout, shard, path, env, options,
      [&](uint32_t k) -> const Subgroup& { return shard.SnapshotAcquire(k); },
      [&](uint32_t k) { shard.SnapshotReleaseBelow(k); });
}

absl::Status LoadShard(ShardState* shard, const std::string& path, Env* env) {
  // Pass 1: layout and every checksum, touching nothing.
  DOS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> verify,
                       CheckpointReader::Open(path, env));
  DOS_RETURN_IF_ERROR(CheckLayoutMatches(verify->layout(), *shard, path));
  DOS_RETURN_IF_ERROR(verify->VerifyAll());
  const CheckpointLayout layout = verify->layout();
  verify.reset();

  // Pass 2: the same bytes again, into the state.
  DOS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                       CheckpointReader::Open(path, env));
  absl::Status s = CheckLayoutMatches(reader->layout(), *shard, path);
  if (s.ok()) s = ReadInto(*reader, shard);
  if (!s.ok()) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", path, " changed while it was being loaded; the session's state is "
        "partly overwritten, load an intact checkpoint: ", s.message()));
  }
  std::span<TensorDesc> tensors = shard->tensors();
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].step = layout.tensors[i].step;
  return absl::OkStatus();
}

}  // namespace dos
