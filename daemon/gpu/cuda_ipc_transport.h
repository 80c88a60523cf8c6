// CudaIpcTransport: Transport over CUDA IPC memory handles (GPU mode).
//
// The client exports each CUDA allocation that holds parameters or
// gradients with cudaIpcGetMemHandle and sends the handle, the byte offset of
// the tensor from the allocation's base, the allocation's size and its
// device's UUID. Map() opens each distinct handle once
// (cudaIpcOpenMemHandle, in the daemon's context on its own device) and
// checks every range against the allocation's size. The mappings are closed
// when the transport is destroyed (session end or client death); the memory
// itself stays the trainer's.
//
// Errors: FAILED_PRECONDITION when the allocation lives on another GPU than
// this transport's engine (UUIDs compared; Session::Register already picked
// the engine by UUID, so this is a second line of defence), INVALID_ARGUMENT for a range past the end of
// its allocation or a malformed handle, INTERNAL when CUDA refuses the handle.
// shm locations fall through to a ShmTransport, so one session may mix them.
//
// Thread-safety: not thread-safe (see transport.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "daemon/sched/device_selection.h"
#include "daemon/transport/shm_transport.h"
#include "daemon/transport/transport.h"

namespace dos::gpu {

// (daemon/sched/device_selection.h, kept CUDA-free for the engine matching.)
using ::dos::FormatDeviceUuid;

class CudaIpcTransport final : public Transport {
 public:
  // `device`: the daemon's CUDA device ordinal; `device_uuid`: its UUID as
  // FormatDeviceUuid writes it.
  CudaIpcTransport(int device, std::string device_uuid);
  ~CudaIpcTransport() override;
  CudaIpcTransport(const CudaIpcTransport&) = delete;
  CudaIpcTransport& operator=(const CudaIpcTransport&) = delete;

  absl::StatusOr<void*> Map(const MemoryRef& ref, uint64_t bytes, absl::string_view what) override;
  size_t num_mappings() const { return mappings_.size(); }

 private:
  struct Mapping {
    void* base = nullptr;
    uint64_t alloc_bytes = 0;
  };
  const int device_;
  const std::string device_uuid_;
  std::map<std::string, Mapping> mappings_;  // by handle bytes
  ShmTransport shm_;
};

}  // namespace dos::gpu
