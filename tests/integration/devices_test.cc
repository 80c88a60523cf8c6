// Devices (no GPU needed): --gpu_devices on the real dosd, and how Register
// binds a session to a GPU engine by the device UUID of its CUDA IPC tensors:
// a UUID no engine drives, and tensors on two devices, are refused with
// errors that name the tensor, the devices and the fix. Host-memory sessions
// run with no GPU engine at all and are listed as device "host". (Two ranks
// on two GPUs against one dosd: tests/gpu/multi_gpu_test.cc.)
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <string>

#include "dos/dos.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "dos/wire/control_block.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "tests/support/daemon_fixture.h"

namespace dos::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kUuidA[] = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
constexpr char kUuidB[] = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

class DevicesTest : public DaemonFixture {
 protected:
  DevicesTest() : DaemonFixture({"--gpu_devices=none", "--cpu_threads=1", "--session_lease=0"}) {}
  // RegisterShard of tensors "a" and "b" whose param and grad claim CUDA IPC
  // allocations on the devices `uuid_a` and `uuid_b` (the handles are never
  // opened: the device is checked first).
  grpc::Status RegisterOn(const std::string& uuid_a, const std::string& uuid_b) {
    auto stub = Stub();
    v1::AttachRequest areq;
    areq.set_client_name("devices_test");
    areq.set_pid(getpid());
    areq.set_protocol_version(kProtocolVersion);
    areq.set_fd_ticket(FdTicket(daemon_.socket()));
    v1::AttachResponse aresp;
    {
      grpc::ClientContext ctx;
      grpc::Status st = stub->Attach(&ctx, areq, &aresp);
      if (!st.ok()) return st;
    }
    v1::RegisterShardRequest req;
    *req.mutable_session() = aresp.session();
    AddAdamGroup(&req);
    for (auto [name, uuid] : {std::pair{"a", uuid_a}, std::pair{"b", uuid_b}}) {
      auto* t = req.add_tensors();
      t->set_name(name);
      t->set_param_dtype(v1::DTYPE_BF16);
      t->set_grad_dtype(v1::DTYPE_BF16);
      t->set_numel(1024);
      for (auto* loc : {t->mutable_param(), t->mutable_grad()}) {
        auto* c = loc->mutable_cuda_ipc();
        c->set_handle(std::string(64, '\x01'));
        c->set_alloc_bytes(2048);
        c->set_device_uuid(uuid);
      }
    }
    grpc::ClientContext ctx;
    v1::RegisterShardResponse resp;
    return stub->RegisterShard(&ctx, req, &resp);
  }

  // No GPU engine, whatever the machine has.
};

TEST_F(DevicesTest, UnknownDeviceIsRefusedNamingItAndTheFlag) {
  grpc::Status st = RegisterOn(kUuidA, kUuidA);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("tensor 0 (a) param"));
  EXPECT_THAT(st.error_message(), HasSubstr(kUuidA));
  EXPECT_THAT(st.error_message(), HasSubstr("--gpu_devices"));
}

TEST_F(DevicesTest, TensorsOnTwoDevicesAreRefusedNamingTheTensorAndBothDevices) {
  grpc::Status st = RegisterOn(kUuidA, kUuidB);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("tensor 1 (b) param"));
  EXPECT_THAT(st.error_message(), HasSubstr(kUuidA));
  EXPECT_THAT(st.error_message(), HasSubstr(kUuidB));
  EXPECT_THAT(st.error_message(), HasSubstr("one device"));
}

TEST_F(DevicesTest, HostSessionTrainsWithoutGpuAndIsListedAsHost) {
  dos_session* s = nullptr;
  ASSERT_EQ(AttachClient(daemon_.socket(), "devices_test.host", &s), DOS_OK) << dos_last_error();
  void *w = nullptr, *g = nullptr;
  ASSERT_EQ(dos_buffer_alloc(s, 64 * 4, &w), DOS_OK) << dos_last_error();
  ASSERT_EQ(dos_buffer_alloc(s, 64 * 4, &g), DOS_OK) << dos_last_error();
  dos_tensor t{"w", DOS_DTYPE_F32, w, DOS_DTYPE_F32, g, 64, 0};
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  ASSERT_EQ(dos_register(s, &t, 1, &h, 1, nullptr), DOS_OK) << dos_last_error();
  dos_step_args a;
  dos_step_args_init(&a);
  a.groups = &h;
  a.num_groups = 1;
  dos_step_result r;
  ASSERT_EQ(dos_step(s, &a, &r), DOS_OK) << dos_last_error();
  EXPECT_EQ(r.step, 1);

  auto stub = Stub();
  {
    grpc::ClientContext ctx;
    v1::ListSessionsResponse list;
    ASSERT_TRUE(stub->ListSessions(&ctx, v1::ListSessionsRequest(), &list).ok());
    ASSERT_EQ(list.sessions_size(), 1);
    EXPECT_EQ(list.sessions(0).device(), "host");
    EXPECT_EQ(list.sessions(0).device_uuid(), "");
  }
  {
    grpc::ClientContext ctx;
    v1::GetStatsResponse stats;
    ASSERT_TRUE(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    EXPECT_EQ(stats.gpu_engines_size(), 0);
    ASSERT_EQ(stats.sessions_size(), 1);
    EXPECT_EQ(stats.sessions(0).device(), "host");
  }
  EXPECT_EQ(dos_detach(s), DOS_OK);
}

// dosd refuses a bad --gpu_devices at start-up with a message naming it.
void ExpectRefused(std::vector<std::string> flags, const std::string& message) {
  DaemonProcess d(std::move(flags));
  ASSERT_FALSE(d.Start()) << d.log();  // it exited (Start reaps it)
  EXPECT_THAT(d.log(), HasSubstr(message));
}

TEST(GpuDevicesFlag, BadValuesAreRefusedAtStartup) {
  ExpectRefused({"--gpu_devices=gpu0"}, "--gpu_devices=gpu0");
  ExpectRefused({"--gpu_devices=0,0"}, "twice");
  ExpectRefused({"--gpu_device=0", "--gpu_devices=1"}, "give only --gpu_devices");
}

TEST(GpuDevicesFlag, DeprecatedGpuDeviceStillWorks) {
  DaemonProcess d({"--gpu_device=-1", "--cpu_threads=1"});
  ASSERT_TRUE(d.Start()) << d.log();
  EXPECT_EQ(d.Stop(), 0) << d.log();
}

}  // namespace
}  // namespace dos::testing
