// ClientSession: one trainer process's session with dosd.
//
// Owns the gRPC channel to the daemon, the mapping of the session's control
// block, and every shared-memory buffer allocated for the session. Control
// calls (attach, register, state transfer, policy) go over gRPC; steps go
// through the control block and its doorbells only (see
// dos/wire/control_block.h).
//
// Memory travels by descriptor (proto/dos/wire/fd_protocol.h): Attach
// proves who we are on dosd's descriptor socket (Hello) and fetches the
// control block's memfd there; buffers are sealed memfds that Register (and
// state transfer) send there before naming them by id. Nothing has a name in
// /dev/shm. Buffers stay mapped until the session is destroyed.
//
// Thread-safety: not thread-safe; one thread at a time per session (the C
// ABI's contract). Distinct sessions are independent.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "buffer_table.h"
#include "device_memory.h"
#include "device_sync.h"
#include "dos/dos.h"
#include "dos/wire/control_block.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/shm_segment.h"
#include "dos/wire/tensor_desc.h"
#include "dos/wire/unique_fd.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "state_view.h"
#include "step_machine.h"

namespace dos::client {

// The daemon's progress on the registration in flight (control block words).
struct RegisterProgressView {
  uint32_t phase = 0;  // RegisterPhase; 0: none in flight
  const char* phase_name = "";
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  double phase_seconds = 0;
  double total_seconds = 0;
};

class ClientSession {
 public:
  struct Options {
    std::string socket_path;  // unix socket of dosd
    std::string client_name;
    int32_t rank = -1;
    int32_t local_rank = 0;
    int32_t world_size = 1;
    absl::Duration rpc_timeout = absl::Seconds(30);  // per control-plane call
    // Non-zero: re-attach to this session of a process that died (its state
    // was kept for the daemon's --session_lease), proving it with its token.
    uint64_t resume_session_id = 0;
    std::string resume_token;
  };

  // Connects, attaches and maps the control block. UNAVAILABLE with the
  // socket path and what to do when no daemon answers.
  static absl::StatusOr<std::unique_ptr<ClientSession>> Attach(const Options& options);

  // Detaches (best effort) if Detach() was not called.
  ~ClientSession();
  ClientSession(const ClientSession&) = delete;
  ClientSession& operator=(const ClientSession&) = delete;

  // Closes the session in the daemon. Idempotent; buffers stay mapped until
  // destruction.
  absl::Status Detach();

  uint64_t id() const { return ref_.session_id(); }
  // The session's credential: with id(), what a restarted process passes to
  // resume it. Keep it private to the job.
  const std::string& token() const { return ref_.token(); }
  bool resumed() const { return resumed_; }
  // Safe from any thread while Register runs (reads the control block only).
  RegisterProgressView register_progress() const;

  absl::StatusOr<void*> AllocBuffer(uint64_t bytes);

  absl::Status Register(absl::Span<const dos_tensor> tensors, absl::Span<const dos_hparams> groups,
                        uint64_t subgroup_size);
  // dos_set_state_format: the format the next Register asks for.
  absl::Status SetStateFormat(int format);

  // The step API below follows the session's StepMachine (step_machine.h):
  // a call its step's phase does not allow is FAILED_PRECONDITION.
  absl::Status StepBegin(const dos_step_args& args);
  // GPU mode: records the gradients-ready event on `stream` and begins the
  // step; dosd waits for the event on the GPU.
  absl::Status StepBeginOnStream(const dos_step_args& args, void* stream);
  bool stream_sync() const { return device_sync_ != nullptr; }
  // Waits for subgroups [first, last] of the step in flight: enqueued on
  // `stream` when given and stream_sync(), else on this thread.
  absl::Status WaitSubgroups(uint32_t first, uint32_t last, void* stream, absl::Duration timeout);
  absl::Status TensorSubgroups(uint32_t tensor, uint32_t* first, uint32_t* last) const;
  // timeout < 0: wait until the daemon answers or closes the session.
  absl::Status StepWait(absl::Duration timeout, dos_step_result* result);
  // Early steps (dos.h: dos_step_begin_early, dos_mark_ready,
  // dos_step_verdict, dos_step_abandon).
  absl::Status StepBeginEarly(const dos_step_args& args, uint32_t flags, void* stream);
  absl::Status MarkReady(uint32_t first, uint32_t last, void* stream);
  // `args` null: abandon the step (verdict steps only).
  absl::Status StepVerdict(const dos_step_args* args, void* stream);
  // The last collected step's early figures (zeros for other steps).
  void LastEarly(int32_t* early, double* before_verdict_us, double* after_verdict_us,
                 uint64_t* prefetched_bytes) const {
    *early = last_early_;
    *before_verdict_us = last_before_verdict_us_;
    *after_verdict_us = last_after_verdict_us_;
    *prefetched_bytes = last_prefetched_bytes_;
  }

  // The delayed host path (dos.h: dos_set_step_delay,
  // dos_step_finish_delayed, dos_last_step_delay).
  struct DelayFigures {
    uint32_t subgroups = 0;
    uint64_t params = 0;
    double update_us = 0, wait_us = 0, window_us = 0, predicted_update_us = 0,
           predicted_iter_us = 0;
  };
  absl::Status SetStepDelay(uint32_t delay);
  // The verdict of the early step in flight carries kStepGradientsRewritten.
  absl::Status GradientsRewritten();
  // Protocol 9 (control_block.h): stops dosd's captures of the early delayed
  // step in flight before the trainer scales its gradients in place; with
  // `stream` (GPU mode) the stream waits for them, otherwise this thread,
  // up to `timeout`. Then GradientsScaled(coef) has the verdict carry
  // kStepGradientsScaled with the coefficient.
  absl::Status StopCaptures(void* stream, absl::Duration timeout);
  absl::Status GradientsScaled(float coef);
  // Protocol 11: the coefficient is the float at `device_coef` once the
  // work queued on `stream` is done, copied into the block there.
  absl::Status GradientsScaledOnStream(const void* device_coef, void* stream);
  absl::Status FinishDelayed(void* stream, absl::Duration timeout);
  const DelayFigures& last_delay() const { return last_delay_; }

  // State transfer of one tensor (registration order). NULL parts are
  // skipped on read and kept on write.
  absl::Status ReadState(uint32_t tensor, float* master, float* exp_avg, float* exp_avg_sq,
                         int64_t* step);
  absl::Status WriteState(uint32_t tensor, const float* master, const float* exp_avg,
                          const float* exp_avg_sq, int64_t step);
  // The same for elements [offset, offset + count) of the tensor. Whole
  // tensors and ranges alike travel in pieces of at most
  // kStateTransferChunk elements through one shared-memory buffer of
  // 12 bytes per element of a piece (48 MiB at most).
  static constexpr uint64_t kStateTransferChunk = uint64_t{4} << 20;
  absl::Status ReadStateRange(uint32_t tensor, uint64_t offset, uint64_t count, float* master,
                              float* exp_avg, float* exp_avg_sq, int64_t* step);
  absl::Status WriteStateRange(uint32_t tensor, uint64_t offset, uint64_t count,
                               const float* master, const float* exp_avg, const float* exp_avg_sq,
                               int64_t step);

  absl::Status SetPolicy(const std::string& policy);
  // Zero-copy state views (state_view.h): Fetch asks dosd for the state map
  // now; state_views() maps from the last one fetched.
  absl::Status FetchStateViews() { return views_.Fetch(fd_socket_, id(), token()); }
  const StateViews& state_views() const { return views_; }
  // The GPU lease the following steps carry (dos_set_gpu_lease).
  void SetGpuLease(const dos_gpu_lease& lease) {
    lease_ = lease;
    lease_set_ = true;
  }

 private:
  ClientSession(Options options, std::shared_ptr<grpc::Channel> channel);

  // Turns a failed RPC into an absl::Status naming the call (and the socket
  // when the daemon is unreachable).
  absl::Status FromRpc(const char* call, const grpc::Status& status) const;
  // Deadline: the control-plane timeout plus `extra` (for calls whose work
  // grows with the shard's size).
  void PrepareContext(grpc::ClientContext* context,
                      absl::Duration extra = absl::ZeroDuration()) const;
  absl::StatusOr<std::unique_ptr<ShmSegment>> CreateSegment(uint64_t bytes, bool transfer);
  // Sends segments over the descriptor socket; their ids in order.
  absl::StatusOr<std::vector<uint64_t>> SendSegments(const std::vector<const ShmSegment*>& segs);
  std::string fd_socket_;
  StateViews views_;
  UniqueFd daemon_connection_;  // see ControlBlockChannel::SetDaemonConnection
  absl::Status CheckTensor(uint32_t tensor, const char* call) const;
  absl::Status CheckRange(uint32_t tensor, uint64_t offset, uint64_t count,
                          const char* call) const;
  // One ExportState (import false) or ImportState RPC of elements
  // [offset, offset + count) through `seg`.
  absl::Status TransferPiece(bool import, uint32_t tensor, uint64_t offset, uint64_t count,
                             const ShmSegment& seg, int64_t step, int64_t* step_out);

  Options options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Dos::Stub> stub_;
  v1::SessionRef ref_;
  bool attached_ = false;
  bool resumed_ = false;

  std::unique_ptr<ShmSegment> control_segment_;
  ControlBlock* control_ = nullptr;
  std::unique_ptr<ControlBlockChannel> step_channel_;
  // After control_segment_: unregisters the block before it is unmapped.
  std::unique_ptr<DeviceSync> device_sync_;
  // Step-in-flight watchdog: if dosd dies or closes the session while a step
  // is in flight, it stores that step's seq into every progress word, so a
  // CUDA stream waiting on them (cuStreamWaitValue32) is released instead of
  // hanging the trainer's GPU forever; the step itself then reports
  // UNAVAILABLE at dos_step_wait, and host waits report it at once.
  void WatchSteps();
  // How long the destructor lets the device pass the released stream waits.
  static constexpr absl::Duration kDrainTimeout = absl::Seconds(20);
  std::atomic<uint32_t> inflight_seq_{0};  // 0: none
  std::atomic<bool> abandoned_{false};     // the watchdog released a step
  absl::Mutex watchdog_mu_;
  bool watchdog_stop_ ABSL_GUARDED_BY(watchdog_mu_) = false;
  std::thread watchdog_;
  std::vector<std::pair<uint32_t, uint32_t>> tensor_subgroups_;  // per tensor
  uint32_t num_subgroups_ = 0;
  uint32_t seq_ = 0;  // seq of the last published step
  // The step in flight and its kind (its phase).
  StepMachine step_;
  // Refuses a begin without tensors or with a step in flight.
  absl::Status CheckBegin() const;
  // FAILED_PRECONDITION naming `call` unless StopCaptures came first.
  absl::Status CheckStopped(absl::string_view call) const;
  // Publishes step `args` with `extra_flags` and takes transition `begin`.
  absl::Status Publish(const dos_step_args& args, uint32_t extra_flags, StepEvent begin);
  // The early step in flight: which subgroups were marked ready, and how
  // many of those sharing the last ready word are still unmarked.
  std::vector<uint8_t> ready_marked_;
  uint32_t tail_unmarked_ = 0;
  int32_t last_early_ = 0;
  double last_before_verdict_us_ = 0;
  double last_after_verdict_us_ = 0;
  uint64_t last_prefetched_bytes_ = 0;
  uint32_t delay_ = 0;          // SetStepDelay
  bool rewritten_ = false;      // GradientsRewritten, for the next verdict
  bool stopped_ = false;        // StopCaptures, for the early step in flight
  std::optional<float> scaled_;  // GradientsScaled, for the next verdict
  bool scaled_on_stream_ = false;  // GradientsScaledOnStream, for the next verdict
  bool finishing_ = false;      // the request in flight is a FinishDelayed
  DelayFigures last_delay_;
  // Marks subgroup `i` of the early step ready (on `stream` with stream sync).
  absl::Status MarkOne(uint32_t i, void* stream);
  // GPU lease: the one to send, and the last one sent (a first or lower one
  // waits in StepBegin for dosd to apply it).
  dos_gpu_lease lease_{};
  bool lease_set_ = false;
  bool lease_sent_ = false;
  uint64_t lease_sent_bytes_ = 0;

  std::vector<std::unique_ptr<ShmSegment>> buffers_;
  BufferTable table_;
  DeviceMemory device_;  // CUDA allocations exported at registration
  uint64_t next_segment_ = 0;

  bool registered_ = false;
  int state_format_ = 0;  // dos_state_format for RegisterShardRequest.state_format
  size_t num_groups_ = 0;
  std::vector<TensorDesc> tensors_;  // as registered
};

}  // namespace dos::client
