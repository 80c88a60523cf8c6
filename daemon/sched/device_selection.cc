#include "daemon/sched/device_selection.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace dos {

absl::StatusOr<GpuDeviceSelection> ParseGpuDevices(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  GpuDeviceSelection s;
  if (text == "all") return s;
  s.all = false;
  if (text == "none") return s;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    part = absl::StripAsciiWhitespace(part);
    int ordinal = -1;
    if (!absl::SimpleAtoi(part, &ordinal) || ordinal < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--gpu_devices=", text, ": \"", part, "\" is not a CUDA device ordinal; write all, "
          "none or a comma-separated list such as 0,1"));
    }
    if (std::find(s.ordinals.begin(), s.ordinals.end(), ordinal) != s.ordinals.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--gpu_devices=", text, " names device ", ordinal, " twice"));
    }
    s.ordinals.push_back(ordinal);
  }
  return s;
}

absl::StatusOr<GpuDeviceSelection> GpuDevicesFromFlags(absl::string_view gpu_devices,
                                                       absl::string_view deprecated) {
  deprecated = absl::StripAsciiWhitespace(deprecated);
  if (deprecated.empty()) return ParseGpuDevices(gpu_devices);
  if (absl::StripAsciiWhitespace(gpu_devices) != "all") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu_device=", deprecated, " and --gpu_devices=", gpu_devices,
        " both given; --gpu_device is deprecated: give only --gpu_devices"));
  }
  int ordinal = 0;
  if (!absl::SimpleAtoi(deprecated, &ordinal) || ordinal < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu_device=", deprecated, " is not a CUDA device ordinal or -1; it is deprecated: "
        "use --gpu_devices=all|none|0,1,..."));
  }
  GpuDeviceSelection s;
  s.all = false;
  if (ordinal >= 0) s.ordinals.push_back(ordinal);
  return s;
}

absl::StatusOr<std::vector<int>> ResolveGpuDevices(const GpuDeviceSelection& selection,
                                                   int visible) {
  std::vector<int> out;
  if (selection.all) {
    for (int i = 0; i < visible; ++i) out.push_back(i);
    return out;
  }
  for (int ordinal : selection.ordinals) {
    if (ordinal < visible) {
      out.push_back(ordinal);
      continue;
    }
    if (visible == 0) {
      return absl::UnavailableError(absl::StrCat(
          "--gpu_devices names device ", ordinal, " but CUDA sees no device"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu_devices names device ", ordinal, " but CUDA sees ", visible,
        " device(s), 0 to ", visible - 1, " (check CUDA_VISIBLE_DEVICES)"));
  }
  return out;
}

std::string FormatDeviceUuid(absl::string_view raw) {
  if (raw.size() != 16) return std::string(raw);
  const auto* b = reinterpret_cast<const unsigned char*>(raw.data());
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
      b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

std::string DescribeDevices(std::span<const GpuDeviceInfo> devices) {
  if (devices.empty()) return "no GPU";
  std::string out;
  for (const GpuDeviceInfo& d : devices) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", "cuda:", d.ordinal, " ", d.uuid,
                    d.name.empty() ? "" : absl::StrCat(" (", d.name, ")"));
  }
  return out;
}

absl::StatusOr<size_t> MatchDeviceUuid(std::span<const GpuDeviceInfo> devices,
                                       absl::string_view uuid, absl::string_view what) {
  const std::string text = FormatDeviceUuid(uuid);
  for (size_t i = 0; i < devices.size(); ++i) {
    if (!text.empty() && devices[i].uuid == text) return i;
  }
  if (devices.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " lives on GPU ", text.empty() ? "(no UUID sent)" : text,
        ", but this dosd drives no GPU (built without CUDA, no GPU visible, or started with "
        "--gpu_devices=none); start it with --gpu_devices=all or a list that includes that GPU, "
        "or register host (shared-memory) buffers"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what, " lives on GPU ", text.empty() ? "(no UUID sent)" : text,
      ", which no GPU engine of this dosd drives (it drives ", DescribeDevices(devices),
      "); start dosd with --gpu_devices including that GPU (and a CUDA_VISIBLE_DEVICES that "
      "shows it), or attach to the dosd serving it"));
}

}  // namespace dos
