// CUDA error checks that turn a failed runtime call into an
// absl::Status naming the call, the file and the line (NCCL's checks.h
// habit): every CUDA call in the daemon goes through one of these.
//
//   DOS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(...));  // in a Status function
//   absl::Status s = DOS_CUDA_STATUS(cudaStreamSynchronize(stream));
//
// Thread-safety: stateless.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dos::gpu {

inline absl::Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  // Out of memory is a budget problem the caller can act on; everything else
  // is an internal failure of the device path.
  absl::StatusCode code = err == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted
                                                           : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(expr, " failed: ", cudaGetErrorName(err), " (",
                                         cudaGetErrorString(err), ") at ", file, ":", line));
}

}  // namespace dos::gpu

#define DOS_CUDA_STATUS(expr) ::dos::gpu::CudaStatus((expr), #expr, __FILE__, __LINE__)

#define DOS_CUDA_RETURN_IF_ERROR(expr)                           \
  do {                                                           \
    ::absl::Status dos_cuda_status_ = DOS_CUDA_STATUS(expr);     \
    if (!dos_cuda_status_.ok()) return dos_cuda_status_;         \
  } while (0)
