// StateViews: the owner's zero-copy window on its optimizer state in dosd.
//
// Fetch() asks dosd for the session's state memory (fdproto kStateMemory: a
// read-only descriptor of the state memfd and its state map, state_map.h),
// keeping the map. Map(tensor, array) then builds one contiguous view of a
// tensor's master, exp_avg or exp_avg_sq: a range of address space reserved
// whole, each of the tensor's runs mapped into it (MAP_PRIVATE | MAP_FIXED)
// from the memfd. Nothing is copied: the pages are dosd's (shared, counted in
// the trainer's RssShmem, not its RssAnon), later steps show through them
// like torch's live state tensors, and a write into a view changes only the
// writer's private copy of that page, never dosd's state. A tensor whose runs
// do not start on pages (small tensors, see shard_state.h's map alignment) is
// not mappable: Map() answers FAILED_PRECONDITION and the caller copies.
//
// A view outlives its session and StateViews; Unmap() releases it.
//
// Thread-safety: none; the session's owner calls it between steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dos/wire/state_map.h"
#include "dos/wire/unique_fd.h"

namespace dos::client {

struct StateView {
  void* addr = nullptr;
  uint64_t map_bytes = 0;  // what Unmap releases (whole pages)
  uint64_t numel = 0;
  uint32_t elem_bytes = 4;
};

class StateViews {
 public:
  absl::Status Fetch(const std::string& fd_socket, uint64_t session_id, absl::string_view token);
  bool fetched() const { return state_.valid(); }
  uint32_t num_tensors() const { return header_.num_tensors; }
  uint32_t moment_bytes() const { return header_.moment_bytes; }
  absl::StatusOr<int64_t> Step(uint32_t tensor) const;
  // `which`: 0 master, 1 exp_avg, 2 exp_avg_sq.
  absl::StatusOr<StateView> Map(uint32_t tensor, int which) const;
  static absl::Status Unmap(void* addr, uint64_t map_bytes);
  // True if any page of the view was written (a private copy replaced
  // dosd's page: /proc/self/pagemap shows it anonymous). Reads 8 bytes of
  // pagemap per 4 KiB page, in bounded pieces.
  static absl::StatusOr<bool> Modified(void* addr, uint64_t map_bytes);

 private:
  UniqueFd state_;
  statemap::StateMapHeader header_{};
  std::vector<statemap::StateMapTensor> tensors_;
  std::vector<statemap::StateMapRun> runs_;
};

}  // namespace dos::client
