// Authorizer (who may act on a session) and PeerTable (connection -> kernel
// identity), without a daemon.
#include "daemon/rpc/caller_identity.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gtest/gtest.h"

namespace dos {
namespace {

CallerIdentity Local(uid_t uid, gid_t gid, std::vector<gid_t> groups = {}) {
  CallerIdentity c;
  c.known = true;
  c.uid = uid;
  c.gid = gid;
  c.groups = std::move(groups);
  return c;
}

TEST(AuthorizerTest, OwnerAndOperatorsMayActOthersMayNot) {
  Authorizer a(AuthorizerOptions{{500}, false, 999, {}, {}});
  EXPECT_TRUE(a.MayActOn(Local(1000, 100), 1000, 7, "save").ok());
  EXPECT_TRUE(a.MayActOn(Local(0, 0), 1000, 7, "save").ok());        // root
  EXPECT_TRUE(a.MayActOn(Local(999, 100), 1000, 7, "save").ok());    // dosd's uid
  EXPECT_TRUE(a.MayActOn(Local(1001, 500), 1000, 7, "save").ok());   // primary operator gid
  EXPECT_TRUE(a.MayActOn(Local(1001, 100, {42, 500}), 1000, 7, "save").ok());  // supplementary
  absl::Status st = a.MayActOn(Local(1001, 100, {42}), 1000, 7, "load checkpoint");
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(st.message().find("load checkpoint: session 7 belongs to uid 1000"),
            absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("uid 1001 is neither its owner nor an operator"),
            absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("--operator_gids=500"), absl::string_view::npos) << st;
}

TEST(AuthorizerTest, CallersWithoutIdentityOnlyReadUnlessConfigured) {
  CallerIdentity tcp;
  tcp.peer = "ipv4:127.0.0.1:4242";
  Authorizer strict(AuthorizerOptions{{}, false, 999, {}, {}});
  EXPECT_EQ(strict.MayActOn(tcp, 1000, 1, "save").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(strict.MustBeOperator(tcp, "save all").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(strict.MustBeLocal(tcp, "attach").code(), absl::StatusCode::kPermissionDenied);
  Authorizer open(AuthorizerOptions{{}, true, 999, {}, {}});
  EXPECT_TRUE(open.MayActOn(tcp, 1000, 1, "save").ok());
  EXPECT_TRUE(open.MustBeOperator(tcp, "save all").ok());
  EXPECT_EQ(open.MustBeLocal(tcp, "attach").code(), absl::StatusCode::kPermissionDenied);
}

TEST(AuthorizerTest, AllowListsAdmitListedUidsAndPrimaryOrSupplementaryGids) {
  Authorizer open(AuthorizerOptions{});
  EXPECT_TRUE(open.MayAttach(1000, 100, {}).ok());
  AuthorizerOptions o;
  o.allow_uids = {1000};
  o.allow_gids = {600};
  Authorizer a(o);
  EXPECT_TRUE(a.MayAttach(1000, 100, {}).ok());
  EXPECT_TRUE(a.MayAttach(1001, 600, {}).ok());
  EXPECT_TRUE(a.MayAttach(1001, 100, {42, 600}).ok());
  absl::Status st = a.MayAttach(1001, 100, {42});
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(st.message().find("uid 1001 (gid 100, groups 42) is not in dosd's "
                              "--allow_uids=1000 / --allow_gids=600"),
            absl::string_view::npos) << st;
  std::vector<uint32_t> ids;
  EXPECT_TRUE(ParseIdList("1000,1001", &ids));
  EXPECT_EQ(ids, (std::vector<uint32_t>{1000, 1001}));
  EXPECT_TRUE(ParseIdList("", &ids));
  EXPECT_TRUE(ids.empty());
  EXPECT_FALSE(ParseIdList("1000,bob", &ids));
}

TEST(PeerTableTest, KnowsOnlyTheRecordedSocket) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  struct stat st;
  ASSERT_EQ(::fstat(sv[0], &st), 0);
  PeerTable t;
  t.Record(sv[0], st.st_ino, Local(1234, 55));
  CallerIdentity c = t.Lookup("fd:" + std::to_string(sv[0]));
  EXPECT_TRUE(c.known);
  EXPECT_EQ(c.uid, 1234u);
  EXPECT_FALSE(t.Lookup("fd:" + std::to_string(sv[1])).known);  // never recorded
  EXPECT_FALSE(t.Lookup("ipv4:127.0.0.1:1").known);
  EXPECT_FALSE(t.Lookup("fd:x").known);
  // The descriptor number reused by another socket: not the recorded one.
  const int n = sv[0];
  ::close(sv[0]);
  int other[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, other), 0);
  if (other[0] == n || other[1] == n) {
    EXPECT_FALSE(t.Lookup("fd:" + std::to_string(n)).known);
  }
  ::close(other[0]);
  ::close(other[1]);
  ::close(sv[1]);
}

}  // namespace
}  // namespace dos
