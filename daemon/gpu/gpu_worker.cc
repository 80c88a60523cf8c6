#include "daemon/gpu/gpu_worker.h"

#include <pthread.h>

#include <utility>

namespace dos::gpu {

GpuWorker::GpuWorker(std::string name) : thread_([this, name] { Loop(name); }) {}

GpuWorker::~GpuWorker() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void GpuWorker::Start(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  job_ = std::move(job);
  busy_ = true;
}

void GpuWorker::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](bool* busy) { return !*busy; }, &busy_));
}

void GpuWorker::Loop(std::string name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  for (;;) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](GpuWorker* w) ABSL_NO_THREAD_SAFETY_ANALYSIS { return w->stop_ || w->job_ != nullptr; },
          this));
      if (job_ == nullptr) return;  // stopping with nothing to do
      job = std::move(job_);
      job_ = nullptr;
    }
    job();
    absl::MutexLock lock(&mu_);
    busy_ = false;
  }
}

}  // namespace dos::gpu
