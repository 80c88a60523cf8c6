// The adapter's one wrapper (rpc_call.h): statuses map to gRPC's one to one
// with their messages, rights are checked before the handler runs, and
// DosService's handlers refuse callers without the rights through it (an
// in-process daemon: SessionManager over the host engine, no sockets).
#include "daemon/rpc/rpc_call.h"

#include <unistd.h>

#include <grpcpp/server_context.h>

#include "daemon/cpu/cpu_updater.h"
#include "daemon/cpu/host_engine.h"
#include "daemon/rpc/dos_service.h"
#include "daemon/sched/executor_set.h"
#include "daemon/session/session_manager.h"
#include "daemon/state/host_memory_budget.h"
#include "dos/wire/control_block.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

AuthorizerOptions Options(std::vector<gid_t> operator_gids, bool tcp_operator_calls,
                          uid_t daemon_uid) {
  AuthorizerOptions o;
  o.operator_gids = std::move(operator_gids);
  o.tcp_operator_calls = tcp_operator_calls;
  o.daemon_uid = daemon_uid;
  return o;
}

CallerIdentity Local(uid_t uid, gid_t gid) {
  CallerIdentity c;
  c.known = true;
  c.uid = uid;
  c.gid = gid;
  return c;
}

TEST(ServeCallTest, EveryCodeAndMessageReachesGrpcUnchanged) {
  const RpcCall call(CallerIdentity{}, nullptr);
  for (int code = 0; code <= 16; ++code) {
    const auto c = static_cast<absl::StatusCode>(code);
    const std::string message = code == 0 ? "" : absl::StrCat("handler said ", code);
    grpc::Status got = ServeCall(call, CallRights::kAnyone, "t", [&](const RpcCall&) {
      return absl::Status(c, message);
    });
    EXPECT_EQ(static_cast<int>(got.error_code()), code);
    EXPECT_EQ(got.error_message(), message);
  }
}

TEST(ServeCallTest, RightsAreCheckedBeforeTheHandlerRuns) {
  Authorizer authorizer(AuthorizerOptions{});
  const CallerIdentity tcp;  // no kernel identity: a TCP caller
  const RpcCall call(tcp, &authorizer);
  bool ran = false;
  auto handler = [&ran](const RpcCall&) {
    ran = true;
    return absl::OkStatus();
  };
  grpc::Status local = ServeCall(call, CallRights::kLocal, "attach", handler);
  EXPECT_EQ(local.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(local.error_message(), authorizer.MustBeLocal(tcp, "attach").message());
  grpc::Status member = ServeCall(call, CallRights::kMember, "sessions", handler);
  EXPECT_EQ(member.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(member.error_message().find("--tcp_operator_calls"), std::string::npos);
  EXPECT_FALSE(ran);
  EXPECT_TRUE(ServeCall(call, CallRights::kAnyone, "stats", handler).ok());
  EXPECT_TRUE(ran);
}

TEST(ServeCallTest, TcpOperatorsAndLocalCallersAreAdmitted) {
  Authorizer tcp_operators(Options({}, true, 999));
  EXPECT_TRUE(RpcCall(CallerIdentity{}, &tcp_operators).Admit(CallRights::kMember, "s").ok());
  Authorizer plain(AuthorizerOptions{});
  EXPECT_TRUE(RpcCall(Local(1000, 100), &plain).Admit(CallRights::kLocal, "attach").ok());
  EXPECT_TRUE(RpcCall(Local(1000, 100), &plain).Admit(CallRights::kMember, "s").ok());
  // Without an Authorizer (in-process tests only) nothing is checked.
  EXPECT_TRUE(RpcCall(CallerIdentity{}, nullptr).Admit(CallRights::kLocal, "attach").ok());
}

TEST(RpcCallTest, CheckpointOwnerIsTheCallerUnlessAnOperatorNamesAnother) {
  Authorizer authorizer(Options({500}, false, 999));
  const RpcCall user(Local(1000, 100), &authorizer);
  EXPECT_EQ(user.CheckpointOwner(std::nullopt).value(), 1000u);
  EXPECT_EQ(user.CheckpointOwner(1000u).value(), 1000u);
  absl::StatusOr<uint32_t> other = user.CheckpointOwner(1001u);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(other.status().message().find("the checkpoints of uid 1001 are theirs; uid 1000"),
            std::string::npos)
      << other.status();
  EXPECT_EQ(RpcCall(Local(1001, 500), &authorizer).CheckpointOwner(1000u).value(), 1000u);
  EXPECT_EQ(RpcCall(CallerIdentity{}, &authorizer).CheckpointOwner(std::nullopt).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// DosService over an in-process SessionManager: `open` checks nothing (no
// PeerTable, no Authorizer: how the fuzzers use it), `checked` has both, and
// its caller (a ServerContext outside a call has no peer) has no identity.
class DosServiceRightsTest : public testing::Test {
 protected:
  DosServiceRightsTest()
      : cpu_(cpu::CpuUpdaterOptions{.threads = 1}),
        host_(&cpu_),
        executors_(&host_),
        sessions_(SessionOptions{}, Policy{}, &executors_, &budget_),
        open_(&sessions_, &budget_, "test"),
        authorizer_(Options({}, false, 999)),
        checked_(&sessions_, &budget_, "test", nullptr, nullptr, &peers_, &authorizer_) {}

  v1::SessionRef AttachOne() {
    v1::AttachRequest req;
    req.set_client_name("rights");
    req.set_pid(getpid());
    req.set_protocol_version(kProtocolVersion);
    v1::AttachResponse resp;
    grpc::Status st = open_.Attach(nullptr, &req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.session();
  }

  HostMemoryBudget budget_{uint64_t{64} << 20};
  cpu::CpuUpdater cpu_;
  cpu::HostEngine host_;
  ExecutorSet executors_;
  SessionManager sessions_;
  DosService open_;
  PeerTable peers_;
  Authorizer authorizer_;
  DosService checked_;
  grpc::ServerContext ctx_;
};

TEST_F(DosServiceRightsTest, CallerWithoutRightsIsRefusedWithTheAuthorizersMessage) {
  const v1::SessionRef ref = AttachOne();
  v1::DetachRequest detach;
  *detach.mutable_session() = ref;
  v1::DetachResponse detached;
  grpc::Status st = checked_.Detach(&ctx_, &detach, &detached);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  absl::StatusOr<std::shared_ptr<Session>> s = sessions_.FindUnchecked(ref.session_id());
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(st.error_message(),
            authorizer_.MayActOn(peers_.Lookup(ctx_.peer()), (*s)->identity().uid,
                                 ref.session_id(), "detach")
                .message());
  EXPECT_TRUE(sessions_.FindUnchecked(ref.session_id()).ok());  // still attached

  v1::SetPolicyRequest set_default;
  set_default.set_policy("cpu");
  v1::SetPolicyResponse set;
  EXPECT_EQ(checked_.SetPolicy(&ctx_, &set_default, &set).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::AttachRequest attach;
  attach.set_pid(getpid());
  attach.set_protocol_version(kProtocolVersion);
  v1::AttachResponse attached;
  EXPECT_EQ(checked_.Attach(&ctx_, &attach, &attached).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::ListSessionsRequest list;
  v1::ListSessionsResponse listed;
  EXPECT_EQ(checked_.ListSessions(&ctx_, &list, &listed).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // Reads are open to every caller.
  v1::GetStatsRequest stats;
  v1::GetStatsResponse got;
  EXPECT_TRUE(checked_.GetStats(&ctx_, &stats, &got).ok());
  // The owner's (unchecked) call goes through.
  EXPECT_TRUE(open_.Detach(nullptr, &detach, &detached).ok());
}

TEST_F(DosServiceRightsTest, HandlerStatusesKeepTheirCodesAndMessages) {
  v1::DetachRequest detach;  // session_id 0
  v1::DetachResponse detached;
  grpc::Status st = open_.Detach(nullptr, &detach, &detached);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(), "detach: session.session_id is 0; pass the id Attach returned");

  v1::SaveCheckpointRequest save;
  v1::SaveCheckpointResponse saved;
  st = open_.SaveCheckpoint(nullptr, &save, &saved);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(st.error_message(), "checkpoints are off in this dosd: this dosd has no checkpointer");

  v1::AttachRequest old;
  old.set_pid(getpid());
  old.set_protocol_version(kProtocolVersion - 1);
  v1::AttachResponse attached;
  st = open_.Attach(nullptr, &old, &attached);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("the client is older than the daemon"), std::string::npos)
      << st.error_message();

  v1::AttachRequest bad_rank;
  bad_rank.set_pid(getpid());
  bad_rank.set_protocol_version(kProtocolVersion);
  bad_rank.set_rank(4);
  bad_rank.set_world_size(4);
  st = open_.Attach(nullptr, &bad_rank, &attached);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(),
            "attach: rank 4 is invalid for world_size 4; send -1 when not distributed, else 0 <= "
            "rank < world_size");
}

}  // namespace
}  // namespace dos
