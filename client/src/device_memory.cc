#include "device_memory.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#ifdef DOS_CLIENT_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda_util.h"
#endif

namespace dos::client {

bool DeviceMemory::Compiled() {
#ifdef DOS_CLIENT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

#ifndef DOS_CLIENT_WITH_CUDA

absl::StatusOr<std::optional<DeviceRange>> DeviceMemory::Describe(const void*, uint64_t,
                                                                  const std::string&) {
  return std::nullopt;
}

#else

namespace {

// cuMemGetAddressRange (driver API, v2 ABI).
using GetAddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

GetAddressRangeFn AddressRangeFn() {
  static GetAddressRangeFn fn =
      reinterpret_cast<GetAddressRangeFn>(DriverEntryPoint("cuMemGetAddressRange"));
  return fn;
}

std::string UuidText(const cudaUUID_t& uuid) {
  const auto* u = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
                         u[12], u[13], u[14], u[15]);
}

}  // namespace

absl::StatusOr<std::optional<DeviceRange>> DeviceMemory::Describe(const void* ptr, uint64_t bytes,
                                                                  const std::string& what) {
  if (ptr == nullptr) return std::nullopt;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    // No driver, no device, or a pointer CUDA knows nothing of: host memory.
    cudaGetLastError();
    return std::nullopt;
  }
  if (attr.type == cudaMemoryTypeManaged) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is CUDA managed memory, which cannot be shared by CUDA IPC; allocate it with "
              "cudaMalloc (torch: an ordinary CUDA tensor)"));
  }
  if (attr.type != cudaMemoryTypeDevice) return std::nullopt;

  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  auto it = exports_.upper_bound(p);
  if (it == exports_.begin() || p - std::prev(it)->first >= std::prev(it)->second.alloc_bytes) {
    DeviceGuard guard;
    if (cudaError_t e = cudaSetDevice(attr.device); e != cudaSuccess) {
      return CudaFailure(what, "cudaSetDevice", e, "");
    }
    GetAddressRangeFn range = AddressRangeFn();
    if (range == nullptr) {
      return absl::InternalError(absl::StrCat(
          what, ": the CUDA driver does not provide cuMemGetAddressRange; update the driver"));
    }
    unsigned long long base = 0;
    size_t size = 0;
    if (int r = range(&base, &size, static_cast<unsigned long long>(p)); r != 0) {
      return absl::InternalError(absl::StrCat(what, ": cuMemGetAddressRange failed with CUresult ",
                                              r, " for device pointer 0x", absl::Hex(p)));
    }
    cudaIpcMemHandle_t handle;
    if (cudaError_t e = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
        e != cudaSuccess) {
      return CudaFailure(
          what, "cudaIpcGetMemHandle", e,
          "; the memory must come from cudaMalloc (with PyTorch, do not set "
          "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: such memory cannot be exported)");
    }
    cudaDeviceProp prop;
    if (cudaError_t e = cudaGetDeviceProperties(&prop, attr.device); e != cudaSuccess) {
      return CudaFailure(what, "cudaGetDeviceProperties", e, "");
    }
    it = exports_
             .emplace(static_cast<uintptr_t>(base),
                      Export{size, std::string(reinterpret_cast<const char*>(&handle),
                                               sizeof handle),
                             UuidText(prop.uuid), attr.device})
             .first;
  } else {
    it = std::prev(it);
  }
  const Export& x = it->second;
  DeviceRange r{.handle = x.handle,
                .offset = p - it->first,
                .alloc_bytes = x.alloc_bytes,
                .device_uuid = x.device_uuid,
                .device = x.device};
  if (bytes > r.alloc_bytes - r.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " at device pointer 0x", absl::Hex(p), " spans ", bytes, " bytes from offset ",
        r.offset, " of its ", r.alloc_bytes, "-byte CUDA allocation, which has only ",
        r.alloc_bytes - r.offset, " bytes left; check numel and dtype"));
  }
  return r;
}

#endif  // DOS_CLIENT_WITH_CUDA

}  // namespace dos::client
