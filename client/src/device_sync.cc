#include "device_sync.h"

#include <memory>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#ifdef DOS_CLIENT_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime.h>

#include "cuda_util.h"
#endif

namespace dos::client {

#ifdef DOS_CLIENT_WITH_CUDA

namespace {

using WaitValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

#define DOS_SYNC_CUDA(call)                                                       \
  do {                                                                            \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) {                             \
      return CudaFailure("stream sync", #call, e_);                               \
    }                                                                             \
  } while (0)

// Makes `device` current for the scope; the trainer's own current device is
// restored.
class DeviceScope {
 public:
  explicit DeviceScope(int device) : ok_(cudaSetDevice(device) == cudaSuccess) {}
  bool ok() const { return ok_; }

 private:
  DeviceGuard restore_;  // constructed first: saves the current device
  bool ok_;
};

}  // namespace

struct DeviceSync::Impl {
  int device = -1;
  cudaEvent_t event = nullptr;
  void* block = nullptr;           // registered host range
  char* block_device = nullptr;    // its device address
  WaitValue32Fn wait_value32 = nullptr;
  WriteValue32Fn write_value32 = nullptr;  // null: early steps mark readiness on the host

  ~Impl() {
    DeviceScope scope(device);
    if (event != nullptr) cudaEventDestroy(event);
    if (block != nullptr) cudaHostUnregister(block);
    cudaGetLastError();
  }
};

absl::StatusOr<std::unique_ptr<DeviceSync>> DeviceSync::Create(const void* device_ptr,
                                                               void* block,
                                                               uint64_t block_bytes) {
  cudaPointerAttributes attr{};
  DOS_SYNC_CUDA(cudaPointerGetAttributes(&attr, device_ptr));
  std::unique_ptr<DeviceSync> sync(new DeviceSync());
  sync->impl_ = std::make_unique<Impl>();
  Impl& impl = *sync->impl_;
  impl.device = attr.device;
  DeviceScope scope(impl.device);
  if (!scope.ok()) return absl::InternalError("stream sync: cannot select the tensors' device");

  void* fn = DriverEntryPoint("cuStreamWaitValue32");
  if (fn == nullptr) {
    return absl::UnimplementedError(
        "stream sync: the CUDA driver has no cuStreamWaitValue32; the trainer waits on the host");
  }
  impl.wait_value32 = reinterpret_cast<WaitValue32Fn>(fn);
  impl.write_value32 = reinterpret_cast<WriteValue32Fn>(DriverEntryPoint("cuStreamWriteValue32"));

  DOS_SYNC_CUDA(cudaEventCreateWithFlags(&impl.event,
                                         cudaEventDisableTiming | cudaEventInterprocess));
  cudaIpcEventHandle_t handle;
  DOS_SYNC_CUDA(cudaIpcGetEventHandle(&handle, impl.event));
  sync->event_handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));

  DOS_SYNC_CUDA(cudaHostRegister(block, block_bytes,
                                 cudaHostRegisterMapped | cudaHostRegisterPortable));
  impl.block = block;
  void* dev = nullptr;
  DOS_SYNC_CUDA(cudaHostGetDevicePointer(&dev, block, 0));
  impl.block_device = static_cast<char*>(dev);
  return sync;
}

DeviceSync::~DeviceSync() = default;

absl::Status DeviceSync::RecordGradientsReady(void* stream) {
  DeviceScope scope(impl_->device);
  DOS_SYNC_CUDA(cudaEventRecord(impl_->event, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status DeviceSync::StreamWait(void* stream, const std::atomic<uint32_t>* word,
                                    uint32_t value) {
  DeviceScope scope(impl_->device);
  const auto offset = reinterpret_cast<const char*>(word) - static_cast<const char*>(impl_->block);
  const CUdeviceptr addr = reinterpret_cast<CUdeviceptr>(impl_->block_device + offset);
  waits_queued_ = true;
  CUresult r = impl_->wait_value32(static_cast<CUstream>(stream), addr, value,
                                   CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("stream sync: cuStreamWaitValue32 failed with CUresult ", static_cast<int>(r)));
  }
  return absl::OkStatus();
}

absl::Status DeviceSync::StreamWrite(void* stream, std::atomic<uint32_t>* word, uint32_t value) {
  if (impl_->write_value32 == nullptr) {
    return absl::UnimplementedError("stream sync: the CUDA driver has no cuStreamWriteValue32");
  }
  DeviceScope scope(impl_->device);
  const auto offset = reinterpret_cast<const char*>(word) - static_cast<const char*>(impl_->block);
  const CUdeviceptr addr = reinterpret_cast<CUdeviceptr>(impl_->block_device + offset);
  waits_queued_ = true;  // the device must pass it before the block is unregistered
  CUresult r = impl_->write_value32(static_cast<CUstream>(stream), addr, value,
                                    CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(
        "stream sync: cuStreamWriteValue32 failed with CUresult ", static_cast<int>(r)));
  }
  return absl::OkStatus();
}

absl::Status DeviceSync::CopyToBlock(void* stream, void* dst, const void* src, uint64_t bytes) {
  DeviceScope scope(impl_->device);
  waits_queued_ = true;  // the device must pass it before the block is unregistered
  DOS_SYNC_CUDA(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

bool DeviceSync::Drain(absl::Duration timeout) {
  if (!waits_queued_) return true;
  // cudaDeviceSynchronize has no deadline of its own: it runs on a helper
  // thread, and this one waits for it with one. The state is shared so that
  // a helper still blocked after the timeout touches nothing of ours.
  struct Shared {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
  };
  auto shared = std::make_shared<Shared>();
  const int device = impl_->device;
  std::thread([shared, device] {
    if (cudaSetDevice(device) == cudaSuccess) cudaDeviceSynchronize();
    cudaGetLastError();  // a failed context reports it to the trainer's next call, not here
    absl::MutexLock lock(&shared->mu);
    shared->done = true;
  }).detach();
  absl::MutexLock lock(&shared->mu);
  return shared->mu.AwaitWithTimeout(absl::Condition(&shared->done), timeout);
}

#else  // !DOS_CLIENT_WITH_CUDA

struct DeviceSync::Impl {};

absl::StatusOr<std::unique_ptr<DeviceSync>> DeviceSync::Create(const void*, void*, uint64_t) {
  return absl::UnimplementedError("stream sync: libdos_client was built without CUDA");
}
DeviceSync::~DeviceSync() = default;
absl::Status DeviceSync::RecordGradientsReady(void*) {
  return absl::UnimplementedError("stream sync: libdos_client was built without CUDA");
}
absl::Status DeviceSync::StreamWait(void*, const std::atomic<uint32_t>*, uint32_t) {
  return absl::UnimplementedError("stream sync: libdos_client was built without CUDA");
}
absl::Status DeviceSync::StreamWrite(void*, std::atomic<uint32_t>*, uint32_t) {
  return absl::UnimplementedError("stream sync: libdos_client was built without CUDA");
}
absl::Status DeviceSync::CopyToBlock(void*, void*, const void*, uint64_t) {
  return absl::UnimplementedError("stream sync: libdos_client was built without CUDA");
}
bool DeviceSync::Drain(absl::Duration) { return true; }

#endif

}  // namespace dos::client
