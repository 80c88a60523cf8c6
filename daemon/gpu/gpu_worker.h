// GpuWorker: the GPU engine's long-lived thread for the GPU path of each step
// (the step's own thread runs the CPU path meanwhile). Started with the
// engine and joined when it is destroyed, so a step starts no thread.
//
// Thread-safety: Run is called by one thread at a time (the engine's step
// lock serialises steps); the job runs on the worker thread.
#pragma once

#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace dos::gpu {

class GpuWorker {
 public:
  // Starts the thread, named `name` (15 characters at most are kept).
  explicit GpuWorker(std::string name);
  ~GpuWorker();  // finishes the job in progress, then joins
  GpuWorker(const GpuWorker&) = delete;
  GpuWorker& operator=(const GpuWorker&) = delete;

  // Hands `job` to the worker thread and returns at once; Wait() returns
  // when it has finished. At most one job at a time.
  void Start(std::function<void()> job) ABSL_LOCKS_EXCLUDED(mu_);
  void Wait() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop(std::string name) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  std::function<void()> job_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a job was started and has not finished
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace dos::gpu
