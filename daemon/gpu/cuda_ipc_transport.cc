#include "daemon/gpu/cuda_ipc_transport.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_format.h"
#include "daemon/common/log.h"
#include "daemon/gpu/cuda_check.h"

namespace dos::gpu {

CudaIpcTransport::CudaIpcTransport(int device, std::string device_uuid)
    : device_(device), device_uuid_(std::move(device_uuid)) {}

CudaIpcTransport::~CudaIpcTransport() {
  if (mappings_.empty()) return;
  absl::Status st = DOS_CUDA_STATUS(cudaSetDevice(device_));
  for (auto& [handle, m] : mappings_) {
    if (st.ok()) st = DOS_CUDA_STATUS(cudaIpcCloseMemHandle(m.base));
    if (!st.ok()) {
      DOS_LOG_WARNING("gpu.ipc_close_failed", "error", st.message());
      st = absl::OkStatus();
    }
  }
}

absl::StatusOr<void*> CudaIpcTransport::Map(const MemoryRef& ref, uint64_t bytes,
                                            absl::string_view what) {
  if (!ref.is_cuda_ipc()) return shm_.Map(ref, bytes, what);
  if (ref.cuda_ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": CUDA IPC handle has ", ref.cuda_ipc_handle.size(), " bytes, expected ",
        sizeof(cudaIpcMemHandle_t), "; send the bytes of cudaIpcGetMemHandle's handle"));
  }
  std::string uuid = FormatDeviceUuid(ref.device_uuid);
  if (uuid != device_uuid_) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the allocation lives on GPU ", uuid.empty() ? "(no UUID sent)" : uuid,
        " but this transport maps for GPU ", device_uuid_, " (device ", device_,
        "); CUDA IPC works within one device only, and all tensors of a session must be on "
        "one device"));
  }
  if (ref.alloc_bytes == 0 || ref.offset > ref.alloc_bytes ||
      bytes > ref.alloc_bytes - ref.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": range [", ref.offset, ", ", ref.offset + bytes, ") lies outside its CUDA "
        "allocation of ", ref.alloc_bytes, " bytes; pass the allocation's base handle, the "
        "tensor's offset from that base and the allocation's size (cuMemGetAddressRange)"));
  }
  auto it = mappings_.find(ref.cuda_ipc_handle);
  if (it == mappings_.end()) {
    DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, ref.cuda_ipc_handle.data(), sizeof handle);
    void* base = nullptr;
    absl::Status st = DOS_CUDA_STATUS(
        cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess));
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat(what, ": cannot open the CUDA IPC handle (is "
                                                        "the allocation still alive, and from "
                                                        "cudaMalloc?): ", st.message()));
    }
    it = mappings_.emplace(ref.cuda_ipc_handle, Mapping{base, ref.alloc_bytes}).first;
  } else if (it->second.alloc_bytes != ref.alloc_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": alloc_bytes ", ref.alloc_bytes, " differs from the ", it->second.alloc_bytes,
        " sent earlier for the same CUDA allocation"));
  }
  return static_cast<char*>(it->second.base) + ref.offset;
}

}  // namespace dos::gpu
