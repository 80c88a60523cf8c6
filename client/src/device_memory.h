// DeviceMemory: recognises trainer pointers into CUDA device memory and
// describes them as CUDA IPC locations (GPU mode).
//
// dos_register accepts, for each tensor, either memory from dos_buffer_alloc
// (POSIX shared memory) or memory the trainer allocated on a GPU (cudaMalloc,
// or PyTorch's caching allocator, which hands out ranges of larger cudaMalloc
// segments). For the latter, Describe() finds the allocation holding the
// pointer, exports it with cudaIpcGetMemHandle and returns the handle, the
// pointer's byte offset from the allocation's base, the allocation's size and
// the device's UUID in nvidia-smi's text form; the daemon opens the handle in
// its own context and checks device and range again.
//
// Without CUDA: in a build without DOS_WITH_CUDA, and where the CUDA runtime
// finds no driver or no device, Describe() answers "not device memory" for
// every pointer, so the library keeps working in CPU mode on any machine.
// The CUDA runtime is linked statically and only loads the driver
// (libcuda.so.1) on first use, i.e. at the first Describe().
//
// Thread-safety: not thread-safe; one per ClientSession (whose contract is
// one thread at a time). Exported handles are cached per allocation.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace dos::client {

struct DeviceRange {
  std::string handle;       // cudaIpcMemHandle_t bytes (64)
  uint64_t offset = 0;      // bytes from the allocation's base
  uint64_t alloc_bytes = 0; // size of the allocation
  std::string device_uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
  int device = -1;          // CUDA ordinal in this process
};

class DeviceMemory {
 public:
  // True when this library was built with CUDA support.
  static bool Compiled();

  // nullopt: `ptr` is not CUDA device memory (host memory, or no CUDA here).
  // INVALID_ARGUMENT naming `what` when [ptr, ptr + bytes) runs past the end
  // of its allocation or the memory is managed/host-registered (not
  // exportable); INTERNAL when CUDA refuses to export it.
  absl::StatusOr<std::optional<DeviceRange>> Describe(const void* ptr, uint64_t bytes,
                                                      const std::string& what);

 private:
  struct Export {
    uint64_t alloc_bytes;
    std::string handle;
    std::string device_uuid;
    int device;
  };
  std::map<uintptr_t, Export> exports_;  // by allocation base
};

}  // namespace dos::client
