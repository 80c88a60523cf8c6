// CUDA helpers shared by the client's GPU-mode pieces (DeviceMemory,
// DeviceSync). Only for translation units built with DOS_CLIENT_WITH_CUDA.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dos::client {

// A driver API entry point (v12 ABI) reached through the runtime, so that
// the library needs no link-time dependency on libcuda.so; null if the
// driver lacks it.
inline void* DriverEntryPoint(const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

// INTERNAL naming `what`, the call and CUDA's error; clears the error so
// later calls start clean.
inline absl::Status CudaFailure(const std::string& what, const char* call, cudaError_t e,
                                const char* hint = "") {
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", call, " failed: ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ")", hint));
}

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  DeviceGuard() { ok_ = cudaGetDevice(&saved_) == cudaSuccess; }
  ~DeviceGuard() {
    if (ok_) cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = 0;
  bool ok_ = false;
};

}  // namespace dos::client
