// Header-only helpers for tests that drive a real dosd through gRPC or the
// client library (link dos_test_support, dos_client, dos_proto, gRPC):
// a stub on its socket, a client session attach, and a gtest fixture that
// owns a dosd for each test.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "dos/dos.h"
#include "gtest/gtest.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "tests/support/daemon_process.h"

namespace dos::testing {

// A gRPC stub on the dosd listening at unix socket `socket`.
inline std::unique_ptr<v1::Dos::Stub> DosStub(const std::string& socket) {
  return v1::Dos::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
}

// dos_attach to the dosd at `socket` as `client_name`, with default options.
inline dos_status AttachClient(const std::string& socket, const char* client_name,
                               dos_session** out) {
  dos_attach_options o;
  dos_attach_options_init(&o);
  o.socket_path = socket.c_str();
  o.client_name = client_name;
  return dos_attach(&o, out);
}

// Appends a param group with Adam's usual lr 1e-3, betas (0.9, 0.999), eps
// 1e-8 and no weight decay to a raw RegisterShard request; returns it for
// further settings.
inline v1::Hyperparameters* AddAdamGroup(v1::RegisterShardRequest* req) {
  v1::Hyperparameters* g = req->add_groups();
  g->set_lr(1e-3);
  g->set_beta1(0.9);
  g->set_beta2(0.999);
  g->set_eps(1e-8);
  return g;
}

// A test with a dosd of its own: SetUp starts it with the constructor's
// flags, TearDown stops it and expects a clean exit (unless the test already
// stopped or killed it).
class DaemonFixture : public ::testing::Test {
 protected:
  explicit DaemonFixture(std::vector<std::string> flags = {}) : daemon_(std::move(flags)) {}
  void SetUp() override { ASSERT_TRUE(daemon_.Start()) << daemon_.log(); }
  void TearDown() override {
    if (daemon_.pid() > 0) {
      EXPECT_EQ(daemon_.Stop(), 0) << daemon_.log();
    }
  }
  std::unique_ptr<v1::Dos::Stub> Stub() { return DosStub(daemon_.socket()); }

  DaemonProcess daemon_;
};

}  // namespace dos::testing
