// StateFormat: how a session's optimizer state is stored, chosen once at
// registration (RegisterShardRequest.state_format) and fixed for the
// session's life.
//
//   kFp32     fp32 master, exp_avg and exp_avg_sq: 12 bytes per parameter.
//             The default, and what torch.optim.AdamW keeps.
//   kCompact  fp32 master, bf16 exp_avg (round to nearest even) and bf16
//             exp_avg_sq (stochastic rounding): 8 bytes per parameter. The
//             step's arithmetic is fp32 either way; only the stored moments
//             are narrowed (daemon/cpu/adam_kernel.h says why each rounding,
//             bench/cpu_adam/README.md what it costs in loss).
//
// Every interface that shows the state outside the daemon (ExportState,
// ImportState, checkpoints' readers, the Python state_dict) speaks fp32 for
// both formats; conversions are exact from compact to fp32 and round to
// nearest even from fp32 to compact.
//
// Thread-safety: constants and pure functions.
#pragma once

#include <cstdint>
#include <string_view>

namespace dos {

enum class StateFormat : uint32_t { kFp32 = 0, kCompact = 1 };

// Bytes of stored state per parameter (master + exp_avg + exp_avg_sq).
inline constexpr uint64_t StateBytesPerParam(StateFormat f) {
  return f == StateFormat::kCompact ? 8 : 12;
}
// Bytes of one moment element (exp_avg or exp_avg_sq).
inline constexpr uint64_t MomentBytes(StateFormat f) { return f == StateFormat::kCompact ? 2 : 4; }

inline constexpr const char* StateFormatName(StateFormat f) {
  return f == StateFormat::kCompact ? "compact" : "fp32";
}
inline bool ParseStateFormat(std::string_view text, StateFormat* out) {
  if (text == "fp32") {
    *out = StateFormat::kFp32;
  } else if (text == "compact") {
    *out = StateFormat::kCompact;
  } else {
    return false;
  }
  return true;
}
inline constexpr bool IsValidStateFormat(uint32_t v) { return v <= 1; }

}  // namespace dos
