// Device selection for the GPU engines, without CUDA (tested in CPU-only CI):
// parsing --gpu_devices, resolving it against the devices CUDA sees, and
// matching the device UUID a client sends with each CUDA IPC location to the
// engine that drives that device.
//
// UUIDs, not ordinals, name devices across processes: a trainer and dosd may
// see different CUDA_VISIBLE_DEVICES (and so different ordinals), but a GPU's
// UUID is the same everywhere.
//
// Thread-safety: pure functions.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dos {

// What --gpu_devices asks for.
struct GpuDeviceSelection {
  bool all = true;            // every device CUDA sees
  std::vector<int> ordinals;  // when !all: these, in order (empty: no GPU engine)
};

// "all", "none" or a comma-separated list of distinct CUDA ordinals ("0,2").
// INVALID_ARGUMENT for anything else.
absl::StatusOr<GpuDeviceSelection> ParseGpuDevices(absl::string_view text);

// --gpu_devices combined with the deprecated --gpu_device (`deprecated`
// empty: not given; -1: none; N: device N). Giving both (with --gpu_devices
// other than its default "all") is INVALID_ARGUMENT.
absl::StatusOr<GpuDeviceSelection> GpuDevicesFromFlags(absl::string_view gpu_devices,
                                                       absl::string_view deprecated);

// The ordinals to open when CUDA sees `visible` devices. `all` with none
// visible: empty (CPU only). An ordinal >= `visible`: INVALID_ARGUMENT naming
// it and the count (with none visible: UNAVAILABLE, the daemon runs CPU only
// as it does without a GPU).
absl::StatusOr<std::vector<int>> ResolveGpuDevices(const GpuDeviceSelection& selection,
                                                   int visible);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi's form) of 16 raw
// UUID bytes; anything else (text already in that form) is returned as is.
std::string FormatDeviceUuid(absl::string_view raw_or_text);

// One device a GPU engine drives.
struct GpuDeviceInfo {
  int ordinal = -1;  // CUDA ordinal in dosd's process
  std::string uuid;  // as FormatDeviceUuid writes it
  std::string name;  // e.g. "NVIDIA H200"
};

// "cuda:0 GPU-... (NVIDIA H200), cuda:1 GPU-..." or "no GPU".
std::string DescribeDevices(std::span<const GpuDeviceInfo> devices);

// Index in `devices` of the one whose UUID is `uuid` (raw bytes or text).
// FAILED_PRECONDITION otherwise, naming `what` (e.g. "register: tensor 0 (w)
// param"), the UUID, the daemon's devices and the fix (--gpu_devices).
absl::StatusOr<size_t> MatchDeviceUuid(std::span<const GpuDeviceInfo> devices,
                                       absl::string_view uuid, absl::string_view what);

}  // namespace dos
