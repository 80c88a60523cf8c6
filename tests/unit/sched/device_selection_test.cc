// --gpu_devices parsing and resolution, and the UUID -> engine matching that
// binds a GPU-mode session to the engine of its tensors' device.
#include "daemon/sched/device_selection.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace dos {
namespace {

using ::testing::HasSubstr;

TEST(ParseGpuDevicesTest, AllNoneAndLists) {
  absl::StatusOr<GpuDeviceSelection> s = ParseGpuDevices("all");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->all);
  s = ParseGpuDevices("none");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->all);
  EXPECT_TRUE(s->ordinals.empty());
  s = ParseGpuDevices(" 1, 0 ,3");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->all);
  EXPECT_EQ(s->ordinals, (std::vector<int>{1, 0, 3}));
}

TEST(ParseGpuDevicesTest, RejectsGarbageNegativeAndDuplicates) {
  for (const char* bad : {"", "-1", "0,", "gpu0", "0,,1", "1.5", "All"}) {
    absl::StatusOr<GpuDeviceSelection> s = ParseGpuDevices(bad);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  absl::StatusOr<GpuDeviceSelection> s = ParseGpuDevices("0,1,0");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("twice"));
}

TEST(GpuDevicesFromFlagsTest, DeprecatedAlias) {
  absl::StatusOr<GpuDeviceSelection> s = GpuDevicesFromFlags("all", "");
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->all);
  s = GpuDevicesFromFlags("all", "1");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->all);
  EXPECT_EQ(s->ordinals, (std::vector<int>{1}));
  s = GpuDevicesFromFlags("all", "-1");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->all);
  EXPECT_TRUE(s->ordinals.empty());
  s = GpuDevicesFromFlags("0,1", "0");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("only --gpu_devices"));
  EXPECT_EQ(GpuDevicesFromFlags("all", "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GpuDevicesFromFlags("all", "-2").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ResolveGpuDevicesTest, AgainstVisibleCount) {
  GpuDeviceSelection all;
  EXPECT_EQ(*ResolveGpuDevices(all, 0), std::vector<int>{});
  EXPECT_EQ(*ResolveGpuDevices(all, 3), (std::vector<int>{0, 1, 2}));
  GpuDeviceSelection list{.all = false, .ordinals = {1}};
  EXPECT_EQ(*ResolveGpuDevices(list, 2), std::vector<int>{1});
  absl::StatusOr<std::vector<int>> r = ResolveGpuDevices(list, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("device 1"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("CUDA_VISIBLE_DEVICES"));
  // No GPU at all: the daemon falls back to CPU only, as without CUDA.
  EXPECT_EQ(ResolveGpuDevices(list, 0).status().code(), absl::StatusCode::kUnavailable);
  GpuDeviceSelection none{.all = false, .ordinals = {}};
  EXPECT_EQ(*ResolveGpuDevices(none, 4), std::vector<int>{});
}

TEST(FormatDeviceUuidTest, RawBytesAndText) {
  std::string raw;
  for (int i = 0; i < 16; ++i) raw.push_back(static_cast<char>(i * 17));
  EXPECT_EQ(FormatDeviceUuid(raw), "GPU-00112233-4455-6677-8899-aabbccddeeff");
  EXPECT_EQ(FormatDeviceUuid("GPU-00112233-4455-6677-8899-aabbccddeeff"),
            "GPU-00112233-4455-6677-8899-aabbccddeeff");
  EXPECT_EQ(FormatDeviceUuid(""), "");
}

const std::vector<GpuDeviceInfo> kTwo = {
    {0, "GPU-00000000-0000-0000-0000-000000000000", "NVIDIA H200"},
    {1, "GPU-11111111-1111-1111-1111-111111111111", "NVIDIA H200"}};

TEST(MatchDeviceUuidTest, FindsTheEngineOfTheDevice) {
  absl::StatusOr<size_t> i = MatchDeviceUuid(kTwo, "GPU-11111111-1111-1111-1111-111111111111", "t");
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(*i, 1u);
  // The client may send the 16 raw bytes.
  std::string raw(16, '\x11');
  i = MatchDeviceUuid(kTwo, raw, "t");
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(*i, 1u);
  i = MatchDeviceUuid(kTwo, std::string(16, '\0'), "t");
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(*i, 0u);
}

TEST(MatchDeviceUuidTest, UnknownDeviceNamesItTheDaemonsDevicesAndTheFlag) {
  absl::StatusOr<size_t> i = MatchDeviceUuid(kTwo, "GPU-22222222-2222-2222-2222-222222222222",
                                             "register: tensor 0 (w) param");
  ASSERT_EQ(i.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string msg(i.status().message());
  EXPECT_THAT(msg, HasSubstr("register: tensor 0 (w) param"));
  EXPECT_THAT(msg, HasSubstr("GPU-22222222-2222-2222-2222-222222222222"));
  EXPECT_THAT(msg, HasSubstr("cuda:0 GPU-00000000-0000-0000-0000-000000000000"));
  EXPECT_THAT(msg, HasSubstr("cuda:1 GPU-11111111-1111-1111-1111-111111111111"));
  EXPECT_THAT(msg, HasSubstr("--gpu_devices"));
  // No UUID sent never matches, not even a device with an empty UUID.
  std::vector<GpuDeviceInfo> blank = {{0, "", ""}};
  EXPECT_EQ(MatchDeviceUuid(blank, "", "t").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(MatchDeviceUuidTest, NoEngineAtAll) {
  absl::StatusOr<size_t> i = MatchDeviceUuid({}, "GPU-22222222-2222-2222-2222-222222222222", "t");
  ASSERT_EQ(i.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(i.status().message()), HasSubstr("drives no GPU"));
  EXPECT_THAT(std::string(i.status().message()), HasSubstr("--gpu_devices"));
}

}  // namespace
}  // namespace dos
