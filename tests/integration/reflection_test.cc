// dosd answers the standard server reflection protocol, so grpcurl and other
// generic tools can list and call its services without the .proto files.
#include <grpcpp/grpcpp.h>

#include <set>
#include <string>

#include "google/protobuf/descriptor.pb.h"
#include "gtest/gtest.h"
#include "tests/support/daemon_process.h"
#include "tests/integration/proto/grpc/reflection/v1alpha/reflection.grpc.pb.h"

namespace dos::testing {
namespace {

using grpc::reflection::v1alpha::ServerReflection;
using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;

TEST(ReflectionTest, ListsServicesAndDescribesDosV1) {
  DaemonProcess daemon;
  ASSERT_TRUE(daemon.Start()) << daemon.log();
  auto stub = ServerReflection::NewStub(
      grpc::CreateChannel("unix:" + daemon.socket(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->ServerReflectionInfo(&ctx);

  ServerReflectionRequest list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  ServerReflectionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  std::set<std::string> services;
  for (const auto& s : resp.list_services_response().service()) services.insert(s.name());
  EXPECT_TRUE(services.count("dos.v1.Dos")) << resp.DebugString();
  EXPECT_TRUE(services.count("grpc.health.v1.Health")) << resp.DebugString();

  ServerReflectionRequest describe;
  describe.set_file_containing_symbol("dos.v1.Dos");
  ASSERT_TRUE(stream->Write(describe));
  ASSERT_TRUE(stream->Read(&resp));
  ASSERT_GT(resp.file_descriptor_response().file_descriptor_proto_size(), 0)
      << resp.DebugString();
  google::protobuf::FileDescriptorProto file;
  ASSERT_TRUE(file.ParseFromString(resp.file_descriptor_response().file_descriptor_proto(0)));
  EXPECT_EQ(file.package(), "dos.v1");
  bool has_register = false;
  for (const auto& svc : file.service()) {
    for (const auto& m : svc.method()) has_register |= m.name() == "RegisterShard";
  }
  EXPECT_TRUE(has_register);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(daemon.Stop(), 0);
}

}  // namespace
}  // namespace dos::testing
