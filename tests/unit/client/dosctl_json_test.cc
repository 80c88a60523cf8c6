// dosctl --json: one schema; every integer, 64-bit ones included, is a JSON
// number (protobuf's own mapping quotes 64-bit integers).
#include "client/dosctl/json.h"

#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/dos/v1/dos.pb.h"

namespace dos::dosctl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(DosctlJsonTest, SixtyFourBitIntegersAreNumbers) {
  v1::ListSessionsResponse list;
  list.set_daemon_pid(7);
  list.set_daemon_version("0.1.0");
  v1::SessionInfo* s = list.add_sessions();
  s->set_session_id(7);
  s->set_pid(7);
  s->set_client_name("train \"a\"\n");
  s->set_params(std::numeric_limits<uint64_t>::max());
  s->set_host_state_bytes(85899345920);
  const std::string j = ToJson(list);
  EXPECT_THAT(j, HasSubstr("\"session_id\": 7,"));
  EXPECT_THAT(j, HasSubstr("\"pid\": 7,"));
  EXPECT_THAT(j, HasSubstr("\"daemon_pid\": 7,"));
  EXPECT_THAT(j, HasSubstr("\"params\": 18446744073709551615,"));
  EXPECT_THAT(j, HasSubstr("\"host_state_bytes\": 85899345920,"));
  EXPECT_THAT(j, HasSubstr("\"client_name\": \"train \\\"a\\\"\\n\","));
  // Defaults are printed too (every field always present).
  EXPECT_THAT(j, HasSubstr("\"steps\": 0,"));
  EXPECT_THAT(j, HasSubstr("\"device\": \"\","));
  EXPECT_THAT(j, Not(HasSubstr("\"7\"")));
}

TEST(DosctlJsonTest, DoublesNestedMessagesAndEmptyLists) {
  v1::GetStatsResponse stats;
  stats.set_uptime_s(1.5);
  stats.set_host_state_limit_bytes(uint64_t{1} << 40);
  v1::SessionStats* s = stats.add_sessions();
  s->set_session_id(12);
  s->set_params_per_second(2e9);
  s->mutable_last_step()->set_wall_us(0.1);
  s->mutable_last_step()->set_step(3);
  const std::string j = ToJson(stats);
  EXPECT_THAT(j, HasSubstr("\"uptime_s\": 1.5,"));
  EXPECT_THAT(j, HasSubstr("\"host_state_limit_bytes\": 1099511627776,"));
  EXPECT_THAT(j, HasSubstr("\"params_per_second\": 2000000000,"));
  EXPECT_THAT(j, HasSubstr("\"wall_us\": 0.1,"));
  EXPECT_THAT(j, HasSubstr("\"step\": 3,"));
  EXPECT_THAT(j, HasSubstr("\"gpu_engines\": []"));
  EXPECT_EQ(j.back(), '\n');
}

}  // namespace
}  // namespace dos::dosctl
