#include "daemon/delayed_flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int, delayed_cpu_threads, -2,
          "Threads of the delayed update (clients with delay=1), which runs beside the "
          "trainers' forward and backward: N > 0 threads; 0 = as --cpu_threads; -K = "
          "--cpu_threads' count less K, leaving K cores to the trainers' launch threads.");
ABSL_FLAG(int, delayed_cpu_nice, 0,
          "Nice value (0-19) of the delayed update's threads, so that the trainers' launch "
          "threads run first when both want a core; 0 leaves them as dosd's other threads.");
ABSL_FLAG(std::string, delayed_update_start, "captured",
          "When the delayed update (clients with delay=1) starts: captured = as soon as the "
          "step has copied the gradients, beside the rest of its GPU path; result = once the "
          "step's result is posted, so that the step's PCIe copies have host memory to "
          "themselves.");
ABSL_FLAG(bool, delayed_handoff, true,
          "With delay=1 clients that step early (overlap=True): while a delayed update still "
          "runs, the trainer's next step begins beside it, and its copies during backward "
          "take each subgroup as soon as the update is done with it, so that the next update "
          "starts at the verdict, not after every copy. Off under "
          "--delayed_update_start=result (nothing runs to hand off); =false turns it off.");
ABSL_FLAG(bool, delayed_gpu_path, true,
          "With delay=1 clients: delay the streamed subgroups too. Their gradients are "
          "captured with the host path's and their update crosses PCIe during the next "
          "forward and backward (under policy auto as many as the window's PCIe time holds), "
          "so the step keeps only the resident kernels and the copies. Only while one "
          "session steps on the GPU (the update holds its staging slots through the window).");
ABSL_FLAG(bool, delayed_gpu_first, false,
          "With delay=1 clients (implies --delayed_gpu_path): the GPU also takes the "
          "subgroups the CPU would update late, first, as many as the window's PCIe time "
          "holds, and the CPU updates only the rest: the copy engines' traffic instead of the "
          "host cores' beside the trainer's forward and backward.");
ABSL_FLAG(double, delayed_gpu_window_share, 0.9,
          "With delay=1 clients under policy auto: the share of the window (the next forward "
          "and backward) that the GPU's delayed update may take over PCIe, by the model's "
          "time (0.1-2; above 1 it runs on into the next step, beside the CPU's).");
ABSL_FLAG(uint32_t, delayed_gpu_kernel_blocks, 0,
          "Blocks of each kernel of the GPU's delayed update (it waits on PCIe for the host's "
          "gradients and weights, beside the trainer's kernels); 0: a grid of every SM.");
ABSL_FLAG(bool, delayed_gpu_staged, false,
          "The GPU's delayed update copies each subgroup's gradients into GPU memory and its "
          "new weights back by the copy engines, beside its state, so that its kernels touch "
          "GPU memory only and leave the SMs to the trainer at once; each staging slot then "
          "takes 8 more bytes of GPU memory per element of the largest subgroup.");

namespace dos {

absl::Status DelayedFromFlags(EnginesConfig* engines) {
  engines->delayed_cpu_threads = absl::GetFlag(FLAGS_delayed_cpu_threads);
  engines->delayed_cpu_nice = absl::GetFlag(FLAGS_delayed_cpu_nice);
  if (engines->delayed_cpu_nice < 0 || engines->delayed_cpu_nice > 19) {
    return absl::InvalidArgumentError(absl::StrCat("--delayed_cpu_nice=", engines->delayed_cpu_nice,
                                                   " is out of range; use 0 to 19"));
  }
  const std::string start = absl::GetFlag(FLAGS_delayed_update_start);
  if (start != "captured" && start != "result") {
    return absl::InvalidArgumentError(
        absl::StrCat("--delayed_update_start=", start, " is unknown; use captured or result"));
  }
  engines->delayed_start_at_result = start == "result";
  // An update started at the result has no step to be handed to.
  engines->delayed_handoff =
      absl::GetFlag(FLAGS_delayed_handoff) && !engines->delayed_start_at_result;
  engines->delayed_gpu = absl::GetFlag(FLAGS_delayed_gpu_path);
  engines->delayed_gpu_first = absl::GetFlag(FLAGS_delayed_gpu_first);
  engines->delayed_gpu_window_share = absl::GetFlag(FLAGS_delayed_gpu_window_share);
  if (!(engines->delayed_gpu_window_share >= 0.1 && engines->delayed_gpu_window_share <= 2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--delayed_gpu_window_share=", engines->delayed_gpu_window_share,
                     " is out of range; use 0.1 to 2"));
  }
  engines->delayed_gpu_kernel_blocks = absl::GetFlag(FLAGS_delayed_gpu_kernel_blocks);
  engines->delayed_gpu_staged = absl::GetFlag(FLAGS_delayed_gpu_staged);
  return absl::OkStatus();
}

}  // namespace dos
