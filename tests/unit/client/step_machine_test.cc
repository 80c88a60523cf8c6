// The client's step state machine (client/src/step_machine.h): every legal
// path through a step, and every other (phase, event) refused without a move.
#include "client/src/step_machine.h"

#include "dos/wire/control_block.h"

#include <gtest/gtest.h>

#include <set>
#include <utility>
#include <vector>

namespace dos::client {
namespace {

using E = StepEvent;
using P = StepPhase;

// Drives a fresh machine through `events`, expecting each to be legal;
// returns the phases after each.
std::vector<P> Walk(const std::vector<E>& events) {
  StepMachine m;
  std::vector<P> phases;
  for (E e : events) {
    EXPECT_TRUE(m.Go(e).ok()) << StepEventName(e) << " in " << StepPhaseName(m.phase());
    phases.push_back(m.phase());
  }
  return phases;
}

TEST(StepMachineTest, EveryKindOfStepEndsIdle) {
  EXPECT_EQ(Walk({E::kBegin, E::kCollect}), (std::vector<P>{P::kInFlight, P::kIdle}));
  EXPECT_EQ(Walk({E::kBegin, E::kLose}), (std::vector<P>{P::kInFlight, P::kIdle}));
  EXPECT_EQ(Walk({E::kBeginEarly, E::kVerdict, E::kCollect}),
            (std::vector<P>{P::kAwaitingVerdict, P::kInFlight, P::kIdle}));
  EXPECT_EQ(Walk({E::kBeginEarly, E::kAbandon, E::kCollect}),
            (std::vector<P>{P::kAwaitingVerdict, P::kInFlight, P::kIdle}));
  EXPECT_EQ(Walk({E::kBeginEarlyWithoutVerdict, E::kVerdict, E::kLose}),
            (std::vector<P>{P::kAwaitingReady, P::kInFlight, P::kIdle}));
}

TEST(StepMachineTest, EachBeginCarriesTheFlagsTheDaemonDecodes) {
  EXPECT_EQ(BeginFlags(E::kBegin), 0u);
  EXPECT_EQ(BeginFlags(E::kBeginEarly), uint32_t{kStepGradientsPending});
  EXPECT_EQ(BeginFlags(E::kBeginEarlyWithoutVerdict),
            uint32_t{kStepGradientsPending | kStepNoVerdict | kStepGradientsChecked});
  EXPECT_EQ(BeginFlags(E::kCollect), 0u);
}

TEST(StepMachineTest, WhatEachPhaseAllows) {
  StepMachine m;
  EXPECT_FALSE(m.in_flight());
  EXPECT_FALSE(m.awaiting_gradients());
  ASSERT_TRUE(m.Go(E::kBeginEarlyWithoutVerdict).ok());
  EXPECT_TRUE(m.in_flight());
  EXPECT_TRUE(m.awaiting_gradients());
  EXPECT_TRUE(m.without_verdict());
  ASSERT_TRUE(m.Go(E::kVerdict).ok());
  EXPECT_TRUE(m.in_flight());
  EXPECT_FALSE(m.awaiting_gradients());
  EXPECT_FALSE(m.without_verdict());
}

TEST(StepMachineTest, AnyOtherTransitionIsRefusedAndLeavesThePhase) {
  const std::set<std::pair<P, E>> legal = {
      {P::kIdle, E::kBegin},           {P::kIdle, E::kBeginEarly},
      {P::kIdle, E::kBeginEarlyWithoutVerdict},
      {P::kAwaitingVerdict, E::kVerdict}, {P::kAwaitingVerdict, E::kAbandon},
      {P::kAwaitingReady, E::kVerdict},   {P::kInFlight, E::kCollect},
      {P::kInFlight, E::kLose},
  };
  // A path into each phase.
  const std::vector<std::pair<P, std::vector<E>>> into = {
      {P::kIdle, {}},
      {P::kAwaitingVerdict, {E::kBeginEarly}},
      {P::kAwaitingReady, {E::kBeginEarlyWithoutVerdict}},
      {P::kInFlight, {E::kBegin}},
  };
  const E events[] = {E::kBegin,   E::kBeginEarly, E::kBeginEarlyWithoutVerdict, E::kVerdict,
                      E::kAbandon, E::kCollect,    E::kLose};
  for (const auto& [phase, path] : into) {
    for (E e : events) {
      if (legal.count({phase, e})) continue;
      StepMachine m;
      for (E step : path) ASSERT_TRUE(m.Go(step).ok());
      ASSERT_EQ(m.phase(), phase);
      absl::Status st = m.Go(e);
      EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << StepEventName(e);
      EXPECT_NE(st.message().find(StepEventName(e)), absl::string_view::npos) << st;
      EXPECT_EQ(m.phase(), phase);
    }
  }
}

}  // namespace
}  // namespace dos::client
