// libFuzzer target: what the daemon and client trust from shared memory.
// The input is a control block image (any length, mapped as that many bytes)
// followed by nothing else; ControlBlockChannel::Validate must refuse short or
// foreign blocks, and dos::ValidateStepRequest must accept only finite, in-range
// hyperparameters (torch's rules: eps = 0 allowed) for the registered group count (1..kMaxGroups, as
// registration guarantees).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>

#include "daemon/sched/step_executor.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/control_block.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t registered = 1 + data[0] % dos::kMaxGroups;
  data += 1;
  size -= 1;
  // The mapping: exactly `size` bytes (a short mapping must be refused
  // without reading past it; ASan sees an overread).
  // Aligned as a real mapping is (page-aligned; ControlBlock needs 64), with
  // ASan still tracking the exact length.
  constexpr std::align_val_t kAlign{alignof(dos::ControlBlock)};
  auto free_mapped = [](uint8_t* p) { ::operator delete[](p, std::align_val_t{alignof(dos::ControlBlock)}); };
  std::unique_ptr<uint8_t[], decltype(free_mapped)> mapped(
      static_cast<uint8_t*>(::operator new[](size > 0 ? size : 1, kAlign)), free_mapped);
  std::memcpy(mapped.get(), data, size);
  const auto* block = reinterpret_cast<const dos::ControlBlock*>(mapped.get());
  absl::Status valid = dos::ControlBlockChannel::Validate(block, size);
  if (size < sizeof(dos::ControlBlock)) {
    if (valid.ok()) __builtin_trap();  // accepted a block it cannot hold
    return 0;
  }
  // The step request as the daemon reads it, whatever Validate said.
  alignas(dos::StepRequest) unsigned char buf[sizeof(dos::StepRequest)];
  std::memcpy(buf, &block->request, sizeof buf);
  const auto* req = reinterpret_cast<const dos::StepRequest*>(buf);
  absl::Status s = dos::ValidateStepRequest(*req, registered);
  if (s.ok()) {
    // Accepted requests must be usable by the kernels as they are.
    if (req->num_groups != registered || !std::isfinite(req->grad_scale) ||
        !(req->grad_scale > 0) || !std::isfinite(req->clip_coef)) {
      __builtin_trap();
    }
    for (size_t i = 0; i < registered; ++i) {
      const dos::GroupStepParams& g = req->groups[i];
      if (!std::isfinite(g.lr) || !(g.beta1 >= 0 && g.beta1 < 1) ||
          !(g.beta2 >= 0 && g.beta2 < 1) || !(g.eps >= 0) || !std::isfinite(g.eps)) {
        __builtin_trap();
      }
    }
  }
  return 0;
}
