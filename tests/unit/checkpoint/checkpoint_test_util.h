// Helpers shared by the checkpoint tests: shards with awkward layouts filled
// with a deterministic pattern, snapshots to compare against, temp dirs.
#pragma once

#include <stdlib.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "daemon/checkpoint/checkpoint_format.h"
#include "daemon/state/host_memory_budget.h"
#include "daemon/state/shard_state.h"
#include "gtest/gtest.h"

namespace dos::testing {

// A fresh directory under $TEST_TMPDIR or /tmp, removed with its contents.
class TempDir {
 public:
  TempDir() {
    const char* base = getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/dos_ckpt_XXXXXX";
    path_ = mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }
  std::vector<std::string> List() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path_)) {
      out.push_back(e.path().filename());
    }
    return out;
  }

 private:
  std::string path_;
};

// Tensor sizes straddling subgroups of 1000 elements: a tensor inside one
// subgroup, one spanning three, one of a single element, one exactly one
// subgroup, an empty-ish tail.
inline std::vector<uint64_t> AwkwardSizes() { return {7, 2203, 1, 1000, 64, 22}; }

inline std::unique_ptr<ShardState> MakeShard(HostMemoryBudget* budget,
                                             const std::vector<uint64_t>& sizes = AwkwardSizes(),
                                             uint64_t subgroup_size = 1000,
                                             StateFormat format = StateFormat::kFp32) {
  std::vector<TensorDesc> tensors;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TensorDesc t;
    t.name = "layer" + std::to_string(i) + ".weight";
    t.param_dtype = i % 2 ? DType::kBF16 : DType::kF32;
    t.grad_dtype = i % 3 ? DType::kF16 : DType::kF32;
    t.numel = sizes[i];
    t.group = static_cast<uint32_t>(i % 2);
    tensors.push_back(t);
  }
  std::vector<GroupConfig> groups(2);
  groups[0].defaults = GroupStepParams{1e-3, 0.9, 0.999, 1e-8, 0.01};
  groups[1].defaults = GroupStepParams{3e-4, 0.8, 0.99, 1e-6, 0.0};
  groups[1].decoupled_weight_decay = false;
  auto s = ShardState::Create(std::move(tensors), std::move(groups), subgroup_size, budget,
                              "test shard", {.format = format});
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// Writes a pattern that differs per tensor, array, element and `seed`, and
// sets each tensor's step.
inline void Fill(ShardState* shard, uint32_t seed) {
  for (uint32_t t = 0; t < shard->tensors().size(); ++t) {
    std::vector<float> buf(shard->tensors()[t].numel);
    for (int a = 0; a < 3; ++a) {
      for (size_t i = 0; i < buf.size(); ++i) {
        buf[i] = static_cast<float>(seed) * 1000.0f + static_cast<float>(t) * 10.0f +
                 static_cast<float>(a) + static_cast<float>(i) * 1e-3f;
      }
      shard->WriteTensor(t, a, buf.data());
    }
    shard->tensors()[t].step = seed * 100 + t;
  }
}

// Every value and step of a shard, for equality checks.
struct Snapshot {
  std::vector<std::vector<float>> values;  // tensor * 3 + array
  std::vector<int64_t> steps;
  bool operator==(const Snapshot&) const = default;
};

inline Snapshot Take(const ShardState& shard) {
  Snapshot s;
  for (uint32_t t = 0; t < shard.tensors().size(); ++t) {
    for (int a = 0; a < 3; ++a) {
      std::vector<float> buf(shard.tensors()[t].numel);
      shard.ReadTensor(t, a, buf.data());
      s.values.push_back(std::move(buf));
    }
    s.steps.push_back(shard.tensors()[t].step);
  }
  return s;
}

inline std::string ReadAll(const std::string& path) {
  std::string out;
  FILE* f = fopen(path.c_str(), "rb");
  if (f == nullptr) return out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  fclose(f);
  return out;
}

inline void WriteAll(const std::string& path, const std::string& data) {
  FILE* f = fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(fwrite(data.data(), 1, data.size(), f), data.size());
  fclose(f);
}

// `src` bind-mounted read-only at `dst` (a folder) until Unmount() or
// destruction: a file system remounted read-only. bound() is false where
// this process may not mount (not root: skip the test), read_only() where
// the remount failed; why() says what failed.
class ReadOnlyBind {
 public:
  ReadOnlyBind(const std::string& src, const std::string& dst) : dst_(dst) {
    if (::mount(src.c_str(), dst.c_str(), nullptr, MS_BIND, nullptr) != 0) {
      why_ = std::string("cannot bind-mount (") + std::strerror(errno) + "): needs root";
      return;
    }
    bound_ = true;
    if (::mount(nullptr, dst.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) != 0) {
      why_ = std::string("cannot remount read-only: ") + std::strerror(errno);
      return;
    }
    read_only_ = true;
  }
  ~ReadOnlyBind() { Unmount(); }
  ReadOnlyBind(const ReadOnlyBind&) = delete;
  ReadOnlyBind& operator=(const ReadOnlyBind&) = delete;

  bool bound() const { return bound_; }
  bool read_only() const { return read_only_; }
  const std::string& why() const { return why_; }
  // True once nothing is mounted at `dst` by this object.
  bool Unmount() {
    if (!bound_) return true;
    bound_ = read_only_ = false;
    return ::umount2(dst_.c_str(), MNT_DETACH) == 0;
  }

 private:
  std::string dst_;
  std::string why_;
  bool bound_ = false;
  bool read_only_ = false;
};

}  // namespace dos::testing
