// FillStepStats: a session's last step (the executor's StepOutcome) as the
// GetStats reply's StepStats, rates and busy fractions derived from it.
// Stateless; thread-safe.
#pragma once

#include "daemon/sched/step_executor.h"
#include "proto/dos/v1/dos.pb.h"

namespace dos {

// `last_wall_us`: the step's doorbell-to-result time as the session measured it.
void FillStepStats(const StepOutcome& o, double last_wall_us, v1::StepStats* last);

}  // namespace dos
