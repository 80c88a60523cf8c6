// NodeResources: the planners' one view of what the GPU engines of a node
// share, host memory bandwidth (M_host: cores and DMA engines together) and
// the CPU pool's cores (R_cpu), and how they are split between the engines
// that step at the same time (issue 14 item 4).
//
// Each GPU engine's PCIe link, copy engines and GPU kernel are its own (its
// planner's PerfModel keeps those rates); the host's memory and cores are
// not. An engine is *active* while it steps and for a while after: until
// `window_periods` of its own step periods (start to start) or `min_window`,
// whichever is longer (at most `max_window`), have passed since its last
// step ended, so ranks that
// step together in lockstep (DDP after a barrier) count each other even when
// one plans a few milliseconds before the other. An engine alone gets
// everything. Active engines share in proportion to their host demand (the
// parameters of their last step that are not resident on their GPU): equal
// ranks get equal halves, and a rank whose resident tier holds more of its
// state needs, and gets, less of the host. Shares of all active engines sum
// to 1 (an engine without host demand gets 1%, not 0, so no rate is zero).
//
// The node rates are learned from every engine's steps, converted back to
// the node by the share the step was planned with (a step that ran at half
// the host measured half the node's CPU rate). Host memory is two figures:
//  - M_host, the node's: what all engines' traffic together can reach. It
//    is raised, never lowered, by the host traffic of overlapping steps
//    together: at the end of an engine's step, its own traffic rate plus
//    each other engine's last step's rate, weighted by the part of this step
//    it overlapped.
//  - M_engine, each engine's own: the host traffic one engine alone draws
//    (its copy engines and the cores contending on its paths; the bandwidth
//    probe measures exactly this, one GPU's DMA beside the CPU kernel, and
//    seeds it). Raised, never lowered, by the engine's steps that ran alone.
// An engine plans with min(M_engine, share x M_host): alone, its own
// ceiling (which can be below the node's: one engine's DMA does not reach
// what two engines' do); beside others, its share of the node.
// A step's traffic rate is its host bytes over the time they flowed: its
// update time (the executor's wall, not the time since Begin, which holds
// the plan, the prefetch and the verdict wait) less what the model predicts
// apart from host traffic (the pipeline's fill and drain, the resident
// kernels), so the learned rate is the one the model's prediction divides by.
//
// Each engine's last plan (share, predicted and measured update time, its
// parameters, the binding constraint) is kept for stats; the node bound is
// the aggregate rate the shared model predicts for the active engines: all
// their parameters over the slowest one's predicted time (the figure
// bench/e2e/ranks.py measures).
//
// Ownership: ExecutorSet owns one per daemon; planners hold a pointer and
// their engine's id. Thread-safety: thread-safe (one mutex; no call blocks
// while holding it, and it calls out to nothing, so it cannot deadlock with
// the planners' locks, which may be held while calling in).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/sched/perf_model.h"

namespace dos {

struct NodeResourcesOptions {
  absl::Duration min_window = absl::Seconds(1);
  absl::Duration max_window = absl::Seconds(30);
  double window_periods = 1.5;
  // The clock (tests inject one); empty: absl::Now.
  std::function<absl::Time()> now;
};

class NodeResources {
 public:
  using Options = NodeResourcesOptions;

  // What one engine planned and measured in its last step, and its share now.
  struct EngineView {
    std::string name;
    bool active = false;
    double share = 0;              // of M_host and R_cpu, in [0, 1]
    uint64_t params = 0;           // its last step's parameters (resident included)
    uint64_t host_params = 0;      // of which not resident (its host demand)
    double planned_share = 0;      // the share its last plan used
    double predicted_us = 0;       // its last plan's prediction
    double measured_us = 0;        // its last step's update time
    std::string binding;           // its last plan's binding constraint
    double host_alone_bytes_per_s = 0;  // M_engine: its host traffic ceiling alone
  };
  struct View {
    std::vector<EngineView> engines;
    uint32_t active = 0;
    double host_bytes_per_s = 0;   // node M_host
    double cpu_params_per_s = 0;   // node R_cpu (fp32 state)
    // All active engines' parameters / the slowest one's predicted time
    // (0 when none is active or one has no prediction yet).
    double bound_params_per_s = 0;
  };

  explicit NodeResources(Options options = {});
  NodeResources(const NodeResources&) = delete;
  NodeResources& operator=(const NodeResources&) = delete;

  // Adds an engine (start-up); the first one's initial rates become the
  // node's. Returns its id.
  int AddEngine(std::string name, const PerfInputs& initial);
  int engines() const ABSL_LOCKS_EXCLUDED(mu_);

  // Engine `id` starts a step whose non-resident parameters are
  // `host_params`. Returns its share. Every Begin is followed by one End.
  // Steps of several sessions on one engine may overlap: their demands add.
  double Begin(int id, uint64_t host_params) ABSL_LOCKS_EXCLUDED(mu_);
  // Its share now (as Begin computes it, without starting a step).
  double Share(int id) const ABSL_LOCKS_EXCLUDED(mu_);
  // `in` with the node's R_cpu and M_host times `share` in place of the
  // engine's own (the engine's PCIe and GPU rates kept).
  PerfInputs Apply(const PerfInputs& in, double share) const ABSL_LOCKS_EXCLUDED(mu_);
  // The same for engine `id`, whose M_host is min(its M_engine, share x the
  // node's M_host) (what its planner uses).
  PerfInputs Apply(int id, const PerfInputs& in, double share) const ABSL_LOCKS_EXCLUDED(mu_);
  // The plan engine `id` made for the step it began.
  void Planned(int id, uint64_t params, double share, double predicted_us,
               const std::string& binding) ABSL_LOCKS_EXCLUDED(mu_);
  // The step ended (also after a failure: then measured_us 0 and nothing
  // learned). The measurements, for a step planned at `share`: its update
  // time, CPU-path parameters and CPU kernel seconds with `state_bytes` per
  // parameter, `grad_bytes`/`weight_bytes`, the host bytes the step moved,
  // and `other_s`, the seconds of its update time the model predicts apart
  // from host traffic (fill/drain, resident kernels: StepPlanner::NodeStepEnd).
  struct StepEnd {
    double share = 1;
    double measured_us = 0;
    double cpu_params = 0;
    double cpu_busy_s = 0;
    double state_bytes = 12, grad_bytes = 2, weight_bytes = 2;
    double host_bytes = 0;
    double other_s = 0;
  };
  // `host_params`: what its Begin added (steps overlapping on one engine).
  void End(int id, const StepEnd& end, uint64_t host_params = 0) ABSL_LOCKS_EXCLUDED(mu_);

  View Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Time Now() const { return options_.now ? options_.now() : absl::Now(); }

  // RAII: Begin in the constructor, End (measured_us 0) in the destructor
  // unless Finish ran.
  class Step {
   public:
    Step() = default;
    Step(NodeResources* node, int id, uint64_t host_params)
        : node_(node),
          id_(id),
          host_params_(host_params),
          share_(node ? node->Begin(id, host_params) : 1.0) {}
    Step(const Step&) = delete;
    Step& operator=(const Step&) = delete;
    ~Step() {
      if (node_ != nullptr) {
        node_->End(id_, StepEnd{.share = share_}, host_params_);
      }
    }
    void Finish(StepEnd end) {
      if (node_ == nullptr) return;
      node_->End(id_, end, host_params_);
      node_ = nullptr;
    }
    double share() const { return share_; }

   private:
    NodeResources* node_ = nullptr;
    int id_ = -1;
    uint64_t host_params_ = 0;
    double share_ = 1.0;
  };

 private:
  struct Engine {
    std::string name;
    int stepping = 0;     // steps in progress (sessions of one engine may overlap)
    bool stepped = false;
    absl::Time last_start = absl::InfinitePast();
    absl::Time last_end = absl::InfinitePast();
    absl::Duration period = absl::ZeroDuration();
    uint64_t host_params = 0;  // demand: of the steps in progress, else of the last
    // Its last completed step, for the node's host traffic: its update's
    // window and its traffic rate over it (0: none measured).
    absl::Time record_start = absl::InfinitePast();
    absl::Time record_end = absl::InfinitePast();
    double last_host_rate = 0;
    double host_alone = 0;  // M_engine
    EngineView view;
  };
  bool ActiveLocked(const Engine& e, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  double ShareLocked(int id, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::vector<Engine> engines_ ABSL_GUARDED_BY(mu_);
  PerfModel model_ ABSL_GUARDED_BY(mu_);  // only R_cpu and M_host are the node's
};

}  // namespace dos
