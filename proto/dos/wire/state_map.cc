#include "dos/wire/state_map.h"

#include "absl/strings/str_cat.h"

namespace dos::statemap {

absl::StatusOr<StateMap> ParseStateMap(std::span<const std::byte> bytes) {
  auto bad = [](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("state map from dosd: ", why));
  };
  if (bytes.size() < sizeof(StateMapHeader)) return bad("shorter than its header");
  StateMap m;
  m.header = *reinterpret_cast<const StateMapHeader*>(bytes.data());
  const StateMapHeader& h = m.header;
  if (h.magic != kMagic || h.version != kVersion) return bad("wrong magic or version");
  if (h.moment_bytes != 2 && h.moment_bytes != 4) return bad("moment_bytes is not 2 or 4");
  if (h.num_tensors > kMaxTensors || h.num_runs > (uint64_t{1} << 32) ||
      MapBytes(h.num_tensors, h.num_runs) > bytes.size()) {
    return bad("counts exceed its size");
  }
  const auto* t = reinterpret_cast<const StateMapTensor*>(bytes.data() + sizeof(StateMapHeader));
  m.tensors = {t, h.num_tensors};
  m.runs = {reinterpret_cast<const StateMapRun*>(t + h.num_tensors),
            static_cast<size_t>(h.num_runs)};
  const uint64_t elem[3] = {4, h.moment_bytes, h.moment_bytes};
  for (const StateMapTensor& tensor : m.tensors) {
    if (tensor.first_run > h.num_runs || tensor.num_runs > h.num_runs - tensor.first_run) {
      return bad("a tensor's runs lie outside the run table");
    }
    uint64_t covered = 0;
    for (uint64_t r = tensor.first_run; r < tensor.first_run + tensor.num_runs; ++r) {
      const StateMapRun& run = m.runs[r];
      if (run.tensor_offset != covered || run.count > tensor.numel - covered) {
        return bad("a tensor's runs do not cover it in order");
      }
      covered += run.count;
      for (int a = 0; a < 3; ++a) {
        if (run.file_offset[a] > h.file_bytes ||
            run.count > (h.file_bytes - run.file_offset[a]) / elem[a]) {
          return bad("a run lies outside the state file");
        }
      }
    }
    if (covered != tensor.numel) return bad("a tensor's runs do not cover it");
  }
  return m;
}

}  // namespace dos::statemap
