// ControlBlockChannel: the step protocol of dos/wire/control_block.h as
// calls, shared by the daemon (one per session) and the client library.
//
//   client                                daemon (session's step thread)
//   fill block()->request                 seq = WaitRequest(seq, slice)  // loop
//   n = PublishRequest()        ───────▶  read block()->request, run the step
//                                         fill block()->result
//   WaitResult(n, timeout)      ◀───────  PostResult(seq)
//   read block()->result
//
// Ordering comes from the doorbells (dos/wire/doorbell.h): a value
// returned by WaitRequest / WaitResult acquires everything the other side
// wrote before ringing, so request and result are plain data.
//
// Exactly one request is in flight: the client must not touch
// block()->request between PublishRequest() and the OK return of WaitResult()
// for it (Idle() says whether the last request's result has come back). After
// DEADLINE_EXCEEDED it may call WaitResult again for the same seq.
//
// Ownership: a view; the block lives in a ShmSegment the caller owns and
// that outlives the channel. Thread-safety: one client thread and one daemon
// thread per block (each Doorbell has one ringer and one waiter).
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "dos/wire/control_block.h"
#include "dos/wire/doorbell.h"

namespace dos {

class ControlBlockChannel {
 public:
  // How often a waiting client checks `closed` and the daemon's liveness.
  static constexpr absl::Duration kLivenessSlice = absl::Milliseconds(100);

  // Daemon: formats the block in a freshly mapped segment (any contents).
  static void InitBlock(ControlBlock* block, uint64_t session_id, pid_t daemon_pid);
  // Client: FAILED_PRECONDITION if the mapping is too small or is not a
  // control block of this protocol version (both versions in the message).
  static absl::Status Validate(const ControlBlock* block,
                               uint64_t mapped_bytes = sizeof(ControlBlock));
  // True while `pid` names a live (not zombie) process. A reused pid reads
  // as alive; the `closed` flag covers orderly shutdowns.
  static bool ProcessAlive(pid_t pid);

  explicit ControlBlockChannel(ControlBlock* block)
      : block_(block),
        request_(&block->request_bell, &block->daemon_sleeping),
        done_(&block->done_bell, &block->client_sleeping),
        lease_(&block->lease_bell, &block->lease_client_sleeping),
        verdict_(&block->verdict_bell, &block->verdict_daemon_sleeping) {}

  ControlBlock* block() const { return block_; }

  // Client: `fd` is the descriptor-socket connection the control block came
  // on (fd_protocol.h), which dosd holds open for the session; from now on
  // "dosd is alive" means "it has not hung up", not the block's daemon_pid
  // (meaningless in another pid namespace). The caller keeps `fd` open.
  void SetDaemonConnection(int fd) { daemon_connection_ = fd; }
  // Whether dosd still serves this session (the connection above, else
  // ProcessAlive(daemon_pid)).
  bool DaemonAlive() const;

  // --- daemon side ---
  // Waits for a request newer than `last_seq`; returns its seq, or last_seq
  // on timeout (the caller loops, checking its own shutdown flag).
  uint32_t WaitRequest(uint32_t last_seq, absl::Duration timeout) {
    return request_.WaitChange(last_seq, timeout);
  }
  // Publishes block()->result as the answer to `seq`.
  void PostResult(uint32_t seq);
  // Step `seq`'s GPU lease is applied: whatever a lowered lease no longer
  // covers is back in host memory and freed on the GPU (control_block.h).
  void PostLeaseApplied(uint32_t seq) { lease_.Ring(seq); }
  // Marks the session closed; a waiting client returns UNAVAILABLE within
  // kLivenessSlice.
  void Close() { block_->closed.store(1, std::memory_order_release); }
  // Step `seq` has written subgroup `i`'s new weights. Safe from any thread
  // (CUDA host callbacks included). Subgroups past the tracked ones are
  // published by MarkAllDone only.
  void MarkSubgroupDone(uint32_t i, uint32_t seq) {
    if (i + 1 < kMaxTrackedSubgroups) block_->subgroup_done[i].store(seq, std::memory_order_release);
  }
  // Step `seq` of a shard of `num_subgroups` subgroups is over (done,
  // skipped or failed): every word a waiter may watch says so (the tracked
  // ones and the shared last one; a hot path, so not the whole array).
  void MarkAllDone(uint32_t seq, uint32_t num_subgroups) {
    const uint32_t n = std::min(num_subgroups, kMaxTrackedSubgroups - 1);
    for (uint32_t i = 0; i < n; ++i) block_->subgroup_done[i].store(seq, std::memory_order_release);
    block_->subgroup_done[kMaxTrackedSubgroups - 1].store(seq, std::memory_order_release);
    block_->capture_done.store(seq, std::memory_order_release);
  }
  // Gradients scaled in place (control_block.h, protocol 9): whether the
  // trainer asked step `seq`'s captures to stop, and that they have.
  bool CaptureStopped(uint32_t seq) const {
    return static_cast<int32_t>(block_->capture_stop.load(std::memory_order_acquire) - seq) >= 0;
  }
  // Before each capture of step `seq` (protocol 10): says a copy begins,
  // then whether it may (false: the trainer stopped the captures and may
  // already be writing them). Sequentially consistent against StopCaptures
  // and CaptureInFlight: either this sees the stop or the trainer sees the
  // copy and waits for capture_done.
  bool BeginCapture(uint32_t seq) {
    block_->capture_busy.store(seq, std::memory_order_seq_cst);
    return static_cast<int32_t>(block_->capture_stop.load(std::memory_order_seq_cst) - seq) < 0;
  }
  void EndCapture() { block_->capture_busy.store(0, std::memory_order_release); }
  void MarkCapturesDone(uint32_t seq) {
    block_->capture_done.store(seq, std::memory_order_release);
  }
  // The coefficient the trainer's stream copied (protocol 11): read only
  // once the trainer's event after that copy has completed.
  float StreamCoef() const {
    const uint32_t bits = block_->stream_coef.load(std::memory_order_acquire);
    float coef;
    std::memcpy(&coef, &bits, sizeof(coef));
    return coef;
  }

  // Early steps (control_block.h): whether subgroup `i`'s gradients of step
  // `seq` are final (acquire: its gradient writes are visible after true).
  bool SubgroupReady(uint32_t i, uint32_t seq) const {
    const uint32_t w = block_->subgroup_ready[std::min(i, kMaxTrackedSubgroups - 1)].load(
        std::memory_order_acquire);
    return static_cast<int32_t>(w - seq) >= 0;  // cyclic, as cuStreamWaitValue32's GEQ
  }
  // Sleeps (FUTEX_WAIT on the word, no polling) up to `timeout` or until
  // the client's MarkReady wakes it; true when subgroup `i` of step `seq` is
  // ready. A word written by the trainer's GPU stream wakes no one: the
  // caller then passes short timeouts (Session::WaitReady).
  bool WaitSubgroupReady(uint32_t i, uint32_t seq, absl::Duration timeout) {
    std::atomic<uint32_t>* word = ReadyWord(i);
    const uint32_t w = word->load(std::memory_order_acquire);
    if (static_cast<int32_t>(w - seq) >= 0) return true;
    FutexWaitShared(word, w, timeout);
    return SubgroupReady(i, seq);
  }
  // Waits up to `timeout` for step `seq`'s verdict; true when it is in
  // block()->verdict (acquire).
  bool WaitVerdict(uint32_t seq, absl::Duration timeout) { return verdict_.WaitFor(seq, timeout); }

  // --- client side ---
  // Early steps: subgroup `i` of step `seq` is ready (release; CPU path),
  // and dosd, which sleeps on the word (WaitSubgroupReady), is woken.
  // Subgroups from kMaxTrackedSubgroups - 1 on share one word: the caller
  // stores it once all of them are ready.
  void MarkReady(uint32_t i, uint32_t seq) {
    std::atomic<uint32_t>* word = ReadyWord(i);
    word->store(seq, std::memory_order_release);
    FutexWakeShared(word);
  }
  std::atomic<uint32_t>* ReadyWord(uint32_t i) const {
    return &block_->subgroup_ready[std::min(i, kMaxTrackedSubgroups - 1)];
  }
  // Asks step `seq`'s captures before the verdict to stop (protocol 9);
  // then whether a copy of them had begun (protocol 10): only then must the
  // trainer wait for capture_done before it writes the gradients.
  void StopCaptures(uint32_t seq) { block_->capture_stop.store(seq, std::memory_order_seq_cst); }
  bool CaptureInFlight(uint32_t seq) const {
    return block_->capture_busy.load(std::memory_order_seq_cst) == seq;
  }
  std::atomic<uint32_t>* CaptureDoneWord() const { return &block_->capture_done; }
  void* StreamCoefWord() const { return &block_->stream_coef; }
  // Waits until step `seq`'s captures are done (MarkCapturesDone or the
  // step's end). UNAVAILABLE / DEADLINE_EXCEEDED as WaitResult.
  absl::Status WaitCapturesDone(uint32_t seq, absl::Duration timeout);
  // Publishes block()->verdict for early step `seq`.
  void PublishVerdict(uint32_t seq) { verdict_.Ring(seq); }
  // Publishes block()->request as the next step; returns its seq.
  uint32_t PublishRequest();
  // Waits for the result of `seq`. UNAVAILABLE if the daemon closed the
  // session or its process is gone; DEADLINE_EXCEEDED after `timeout`.
  absl::Status WaitResult(uint32_t seq, absl::Duration timeout);
  // Waits until dosd has applied step `seq`'s GPU lease (PostLeaseApplied).
  // UNAVAILABLE / DEADLINE_EXCEEDED as WaitResult.
  absl::Status WaitLeaseApplied(uint32_t seq, absl::Duration timeout);
  // Waits until subgroups [first, last] of step `seq` are done (their words
  // reach seq). UNAVAILABLE / DEADLINE_EXCEEDED as WaitResult.
  absl::Status WaitSubgroups(uint32_t first, uint32_t last, uint32_t seq, absl::Duration timeout);
  // The word a waiter for subgroup `i` watches.
  std::atomic<uint32_t>* DoneWord(uint32_t i) const {
    return &block_->subgroup_done[std::min(i, kMaxTrackedSubgroups - 1)];
  }
  // True when the last published request has its result.
  bool Idle() const {
    return block_->done_bell.load(std::memory_order_acquire) ==
           block_->request_bell.load(std::memory_order_relaxed);
  }

 private:
  ControlBlock* block_;
  int daemon_connection_ = -1;
  Doorbell request_;  // client rings, daemon waits
  Doorbell done_;     // daemon rings, client waits
  Doorbell lease_;    // daemon rings, client waits (after lowering its lease)
  Doorbell verdict_;  // client rings, daemon waits (early steps)
  // WaitSubgroups' and WaitCapturesDone's loop: polls `reached` until true,
  // the session's end or `timeout`; `pending` and `verb` name what is
  // waited for in errors.
  absl::Status PollWords(uint32_t seq, absl::Duration timeout, absl::FunctionRef<bool()> reached,
                         absl::FunctionRef<std::string()> pending, const char* verb);
  // WaitResult's loop for `bell` reaching `seq`; `what` names it in errors.
  absl::Status WaitBell(Doorbell& bell, uint32_t seq, absl::Duration timeout, const char* what);
};

}  // namespace dos
