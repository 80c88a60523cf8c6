// The flags of the delayed update (clients with delay=1; docs/operator-guide.md,
// "The delayed update"): its CPU threads and their nice value, when it starts,
// and the GPU's share of it. Part of the composition root: main.cc calls
// DelayedFromFlags once from its ConfigFromFlags (the flags live here so
// that main.cc stays within the structure test's file size).
//
// Thread-safety: call from main's thread, after absl::ParseCommandLine.
#pragma once

#include "absl/status/status.h"
#include "daemon/engines.h"

namespace dos {

// Fills `engines`' delayed_* fields from the flags; INVALID_ARGUMENT naming
// the flag and the values it takes otherwise.
absl::Status DelayedFromFlags(EnginesConfig* engines);

}  // namespace dos
