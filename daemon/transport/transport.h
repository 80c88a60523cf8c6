// Transport: how the daemon reaches a trainer's tensor memory.
//
// A MemoryRef names a range the client exported (a POSIX shm object today;
// a CUDA IPC allocation for the GPU path). A Transport maps such ranges once,
// at registration, keeps the mappings for the session's lifetime, and
// releases them when destroyed. Implementations: ShmTransport (CPU mode);
// CudaIpcTransport (GPU mode, daemon/gpu).
//
// Thread-safety: not thread-safe; a session maps under its own lock.
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace dos {

struct MemoryRef {
  std::string shm_name;  // POSIX shm object created by the client
  uint64_t offset = 0;   // bytes from the start of the object (or CUDA allocation)
  // CUDA IPC (GPU mode): set when cuda_ipc_handle is non-empty.
  std::string cuda_ipc_handle;  // cudaIpcMemHandle_t bytes (64)
  uint64_t alloc_bytes = 0;     // size of the allocation the handle names
  std::string device_uuid;      // the GPU the allocation lives on (16 raw bytes or text)
  bool is_cuda_ipc() const { return !cuda_ipc_handle.empty(); }
};

inline MemoryRef ShmRef(std::string name, uint64_t offset) {
  MemoryRef r;
  r.shm_name = std::move(name);
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
