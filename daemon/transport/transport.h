// Transport: how the daemon reaches a trainer's tensor memory.
//
// A MemoryRef names a range the client exported: a sealed memfd segment it
// sent over the descriptor socket (by id; the session resolves the id to the
// mapped segment before mapping), or a CUDA IPC allocation for the GPU path. A Transport maps such ranges once,
// at registration, keeps the mappings for the session's lifetime, and
// releases them when destroyed. Implementations: ShmTransport (CPU mode);
// CudaIpcTransport (GPU mode, daemon/gpu).
//
// Thread-safety: not thread-safe; a session maps under its own lock.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dos/wire/shm_segment.h"

namespace dos {

struct MemoryRef {
  uint64_t segment_id = 0;  // the client's memfd, as the descriptor socket numbered it
  // The mapped segment `segment_id` names (Session fills it from its inbox).
  std::shared_ptr<ShmSegment> segment;
  uint64_t offset = 0;   // bytes from the start of the segment (or CUDA allocation)
  // CUDA IPC (GPU mode): set when cuda_ipc_handle is non-empty.
  std::string cuda_ipc_handle;  // cudaIpcMemHandle_t bytes (64)
  uint64_t alloc_bytes = 0;     // size of the allocation the handle names
  std::string device_uuid;      // the GPU the allocation lives on (16 raw bytes or text)
  bool is_cuda_ipc() const { return !cuda_ipc_handle.empty(); }
};

inline MemoryRef SegmentRef(uint64_t segment_id, uint64_t offset) {
  MemoryRef r;
  r.segment_id = segment_id;
  r.offset = offset;
  return r;
}

class Transport {
 public:
  virtual ~Transport() = default;
  // Returns a pointer to `bytes` bytes at `ref`, mapping the underlying
  // object on first use. `what` names the tensor in error messages
  // ("tensor 3 (fc1.weight) grad").
  virtual absl::StatusOr<void*> Map(const MemoryRef& ref, uint64_t bytes,
                                    absl::string_view what) = 0;
};

}  // namespace dos
