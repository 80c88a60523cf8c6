// GroupStepParams: the per-step hyperparameters of one param group. They
// travel in every step request (control_block.h) and are what the Adam kernels
// (daemon/cpu, daemon/gpu) and the shard state's defaults are made of, so they
// live in this dependency-free header rather than in the wire format itself.
#pragma once

namespace dos {

// Per-step hyperparameters of one param group (they change per step under an
// lr scheduler; the weight decay mode is fixed at registration). The layout
// is part of the control block's (kProtocolVersion).
struct GroupStepParams {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
};

}  // namespace dos
