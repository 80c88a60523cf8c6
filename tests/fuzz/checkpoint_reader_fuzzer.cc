// libFuzzer target: the checkpoint reader over arbitrary bytes. Any input must
// be refused with a Status (DATA_LOSS, FAILED_PRECONDITION) or read
// completely; never a crash, hang, sanitizer report or huge allocation.
// The seed corpus is a few valid checkpoints (tests/run_fuzz.sh writes them).
#include <cstddef>
#include <cstdint>
#include <string>

#include "daemon/checkpoint/checkpoint_reader.h"
#include "tests/unit/checkpoint/fake_env.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dos::testing::MemEnv env;
  env.Put("/ckpt", std::string(reinterpret_cast<const char*>(data), size));
  auto reader = dos::CheckpointReader::Open("/ckpt", &env);
  if (!reader.ok()) return 0;
  uint64_t sum = 0;
  const auto& tensors = (*reader)->layout().tensors;
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    for (uint32_t a = 0; a < dos::kNumStateArrays; ++a) {
      auto sink = [&](uint64_t first, const float* v, size_t n) {
        if (n > 0) sum += first + static_cast<uint64_t>(v[n - 1] != 0);
      };
      if (!(*reader)->ReadSection(t, static_cast<dos::StateArray>(a), sink).ok()) return 0;
    }
  }
  (void)(*reader)->Finish();
  return sum == 42 ? 0 : 0;
}
