// DeviceSync: stream-ordered synchronisation between a trainer's CUDA stream
// and dosd, so that a step never blocks the trainer's CPU thread (GPU mode).
//
//  - Gradients ready: an interprocess CUDA event the trainer records on its
//    stream before ringing a step; its handle goes to dosd at registration,
//    and dosd's streams wait on it (kStepTrainerEventRecorded).
//  - Weights ready: the control block (shared memory) is page-locked and
//    mapped into the device's address space here, and the trainer's stream
//    waits on a subgroup's progress word with cuStreamWaitValue32 (GEQ), which
//    dosd stores when that subgroup's new weights are written.
//
// The CUDA runtime is linked statically into libdos_client; driver entry
// points come from cudaGetDriverEntryPointByVersion (no link-time libcuda).
// Streams are the caller's cudaStream_t (PyTorch's stream.cuda_stream), which
// is the driver's CUstream. Built without CUDA, Create() is UNIMPLEMENTED.
//
// Thread-safety: not thread-safe; one per ClientSession.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dos::client {

class DeviceSync {
 public:
  // `device_ptr` is any trainer pointer on the session's device; `block`
  // and `block_bytes` the mapped control block.
  static absl::StatusOr<std::unique_ptr<DeviceSync>> Create(const void* device_ptr, void* block,
                                                            uint64_t block_bytes);
  ~DeviceSync();
  DeviceSync(const DeviceSync&) = delete;
  DeviceSync& operator=(const DeviceSync&) = delete;

  // cudaIpcEventHandle_t bytes, for RegisterShardRequest.cuda_ipc_event.
  const std::string& event_handle() const { return event_handle_; }
  // Records the event on `stream` (nullptr: the legacy default stream).
  absl::Status RecordGradientsReady(void* stream);
  // Makes `stream` wait until `*word` >= value (a word inside the block).
  absl::Status StreamWait(void* stream, const std::atomic<uint32_t>* word, uint32_t value);
  // Enqueues on `stream` a store of `value` into `word` (a word of the
  // registered block) after the work queued there, preceded by a system-wide
  // memory fence (cuStreamWriteValue32 with default flags), so a reader that
  // sees the value sees every write of that work (early steps' ready words).
  absl::Status StreamWrite(void* stream, std::atomic<uint32_t>* word, uint32_t value);
  // Enqueues on `stream` a copy of `bytes` from device memory `src` into
  // `dst`, inside the registered block (asynchronous: the block is
  // page-locked).
  absl::Status CopyToBlock(void* stream, void* dst, const void* src, uint64_t bytes);
  // Whether StreamWait ever queued a wait on a trainer stream.
  bool waits_queued() const { return waits_queued_; }
  // Before the block is unregistered and unmapped: a wait that a stream
  // still holds is read by the GPU only when the stream reaches it, and would
  // then fault on the vanished mapping. The caller first stores values that
  // release every such wait; Drain then waits until the device has passed
  // them (cudaDeviceSynchronize, on a helper thread), for at most `timeout`.
  // True when the device is past them (or none was ever queued). False on
  // timeout: the device is still busy (work of the trainer's own that takes
  // longer, or a wait that nothing releases), and the caller must then leave
  // the block registered and mapped (leak it) rather than block the process
  // (at interpreter exit, forever) or let the GPU fault.
  bool Drain(absl::Duration timeout);

 private:
  DeviceSync() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string event_handle_;
  bool waits_queued_ = false;
};

}  // namespace dos::client
