// The state map: how a session's owner finds its optimizer state in the
// read-only memfd dosd hands it (fdproto::Op::kStateMemory), so that
// state_dict() returns tensors over dosd's memory instead of copies.
//
// dosd answers kStateMemory with two descriptors: the state's memfd
// (read-only) and a sealed memfd holding this map, taken under the session's
// lock at a step boundary:
//
//   StateMapHeader
//   StateMapTensor[num_tensors]   in registration order
//   StateMapRun[num_runs]         each tensor's runs, in tensor order
//
// A run is `count` elements of one tensor, from `tensor_offset`, lying at
// file_offset[a] in the state memfd for array a (0 master, 1 exp_avg,
// 2 exp_avg_sq). Masters are fp32; the moments are fp32, or bf16 in compact
// format (moment_bytes 2). A tensor whose every run starts on a page in every
// array at the same page offset as in the tensor (shard_state.h: map
// alignment) can be mapped as one contiguous view per array; others are read
// by copy (dos_state_read).
//
// Thread-safety: plain data; ParseStateMap is a pure function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/statusor.h"

namespace dos::statemap {

inline constexpr uint32_t kMagic = 0x4d534f44;  // "DOSM"
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kMaxTensors = 1u << 24;

struct StateMapHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t num_tensors;
  uint32_t moment_bytes;  // 4 (fp32 state) or 2 (compact)
  uint64_t num_runs;
  uint64_t file_bytes;  // size of the state memfd
};

struct StateMapTensor {
  uint64_t numel;
  int64_t step;  // steps applied so far: 0 means torch would hold no state yet
  uint64_t first_run;
  uint64_t num_runs;
};

struct StateMapRun {
  uint64_t file_offset[3];
  uint64_t tensor_offset;
  uint64_t count;
};

// A parsed map: views into the bytes it was parsed from.
struct StateMap {
  StateMapHeader header;
  std::span<const StateMapTensor> tensors;
  std::span<const StateMapRun> runs;
};

inline size_t MapBytes(uint64_t num_tensors, uint64_t num_runs) {
  return sizeof(StateMapHeader) + num_tensors * sizeof(StateMapTensor) +
         num_runs * sizeof(StateMapRun);
}

// Checks `bytes` (8-byte aligned) and returns views into it: the header's
// counts fit, every tensor's runs lie inside the run table and cover its
// elements in order, and every run lies inside the state file.
absl::StatusOr<StateMap> ParseStateMap(std::span<const std::byte> bytes);

}  // namespace dos::statemap
