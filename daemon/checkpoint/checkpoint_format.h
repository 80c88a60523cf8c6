// The on-disk format of one session's checkpoint (one shard's optimizer
// state: fp32 master, fp32 or bf16 moments), shared by CheckpointWriter and
// CheckpointReader.
//
// All integers and floats are little-endian; offsets are from the file start.
//
//   FileHeader     48 bytes   magic "DOSCKPT\n", version, layout size, layout
//                             CRC, chunk size, creation time, header CRC
//   Layout         N bytes    subgroup size, owner, groups (hyperparameters),
//                             tensors (name, dtypes, numel, group, step),
//                             version 2 only: the state format (u32, 0 fp32,
//                             1 compact); its CRC is in the header
//   for each tensor t, for each array a in (master, exp_avg, exp_avg_sq):
//     SectionHeader 32 bytes  "SECT", t, a, element count, header CRC
//     chunks                  up to chunk_bytes of values (fp32; the moments
//                             of a compact checkpoint bf16), each followed
//                             by the CRC32C of its bytes extended with its own
//                             file offset (so a chunk moved elsewhere fails)
//   Trailer        32 bytes   magic "DOSCEND\n", section count, its own
//                             offset, CRC
//
// The file's size follows from the header and the layout alone
// (ExpectedFileSize), so a truncated file is refused before any data is read.
// Every CRC is CRC32C (daemon/checkpoint/crc32c.h).
//
// Versions: 1 has no state format (fp32 state); 2 adds it. Writers write
// version 1 for fp32 state (byte for byte what earlier releases wrote, so
// they still read it) and version 2 for compact state. Readers take both.
// Format changes bump kCheckpointVersion; readers refuse later versions.
//
// Either format loads into a session of either format (LoadShard): compact
// moments widen to fp32 exactly, fp32 moments round to nearest even bf16.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dos/wire/dtype.h"
#include "dos/wire/tensor_desc.h"
#include "daemon/state/shard_state.h"

namespace dos {

inline constexpr char kCheckpointMagic[8] = {'D', 'O', 'S', 'C', 'K', 'P', 'T', '\n'};
inline constexpr char kCheckpointTrailerMagic[8] = {'D', 'O', 'S', 'C', 'E', 'N', 'D', '\n'};
inline constexpr uint32_t kCheckpointVersion = 2;         // the newest this build reads
inline constexpr uint32_t kCheckpointVersionNoFormat = 1;  // fp32 state, no format field
inline constexpr uint32_t kSectionTag = 0x54434553;  // "SECT"
inline constexpr uint64_t kFileHeaderBytes = 48;
inline constexpr uint64_t kSectionHeaderBytes = 32;
inline constexpr uint64_t kChunkCrcBytes = 4;
inline constexpr uint64_t kTrailerBytes = 32;
inline constexpr uint32_t kDefaultChunkBytes = 1u << 20;
// Bounds a reader enforces before it trusts a size from the file.
inline constexpr uint32_t kMinChunkBytes = 4;
inline constexpr uint32_t kMaxChunkBytes = 64u << 20;
inline constexpr uint64_t kMaxLayoutBytes = 256u << 20;
inline constexpr uint32_t kMaxNameBytes = 4096;
inline constexpr uint64_t kMaxCheckpointParams = uint64_t{1} << 46;  // 64 Ti parameters

// The three fp32 arrays kept per parameter, in file order.
enum class StateArray : uint32_t { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };
inline constexpr uint32_t kNumStateArrays = 3;
absl::string_view StateArrayName(StateArray a);

// Everything in a checkpoint except the values.
struct CheckpointLayout {
  uint64_t subgroup_size = 0;
  // Who the state belonged to (informational: a restarted daemon shows it to
  // the operator and matches re-attaching trainers with it).
  std::string owner;
  int32_t rank = -1;
  int32_t world_size = 1;
  std::vector<GroupConfig> groups;
  std::vector<TensorDesc> tensors;
  StateFormat state_format = StateFormat::kFp32;  // how the moments are stored

  uint64_t total_params() const;
};

// The file version a layout is written with (see the top of this file).
inline uint32_t FileVersion(const CheckpointLayout& layout) {
  return layout.state_format == StateFormat::kFp32 ? kCheckpointVersionNoFormat
                                                   : kCheckpointVersion;
}
// Bytes per stored value of array `a`: 4 for the master; 4 or 2 (bf16) for
// the moments, by the layout's state format.
inline uint64_t ElementBytes(const CheckpointLayout& layout, StateArray a) {
  return a == StateArray::kMaster ? 4 : MomentBytes(layout.state_format);
}

// Serialises a layout (the Layout block above) for FileVersion(layout).
std::string EncodeLayout(const CheckpointLayout& layout);
// Parses a Layout block of file version `version` (1 or 2), checking every
// count, size, dtype, group index and the state format. DATA_LOSS naming the
// field and its offset within the block.
absl::StatusOr<CheckpointLayout> DecodeLayout(absl::string_view bytes,
                                              uint32_t version = kCheckpointVersionNoFormat);
// INVALID_ARGUMENT if a layout cannot be written (bad dtype, group index out
// of range, too many parameters, name too long).
absl::Status ValidateLayout(const CheckpointLayout& layout);

// Size of a complete checkpoint file for this layout and chunk size.
uint64_t ExpectedFileSize(const CheckpointLayout& layout, uint64_t layout_bytes,
                          uint32_t chunk_bytes);

// Little-endian field access for the fixed-size blocks.
void PutU32(char* p, uint32_t v);
void PutU64(char* p, uint64_t v);
uint32_t GetU32(const char* p);
uint64_t GetU64(const char* p);

}  // namespace dos
