// sec_client: a trainer or operator tool that the security tests run as a
// throwaway user (tests/security/security_env.h starts it after setgroups,
// setgid and setuid). It performs the operations named on its command line in
// order and prints one line per operation on stdout:
//
//   OK <op> key=value ...        or        ERR <op> code=<grpc code> msg=<text>
//
// Usage: sec_client SOCKET_OR_tcp:HOST:PORT OP...
//   attach:name=N,rank=R          dos_attach (the client library, as a trainer)
//   register:numel=K[,subgroup=S] allocate shared memory, dos_register one f32 tensor
//   step[:n=K,bad=1]              K steps with gradients of 0.5 (default 1); bad=1: with
//                                 grad_scale -1, which dosd refuses (every step fails)
//   many:n=N[,numel=K]            N more sessions, each attached and registered
//   stall                         one step, then an early step (dos_step_begin_early) whose
//                                 verdict does not come until `verdict`: dosd holds the
//                                 session waiting for it; prints held=1 once this uid's
//                                 early-step count says so (GetStats; held=0 after 10 s)
//   verdict                       the stalled step's verdict, and its result
//   state_write:step=S            dos_state_write of tensor 0 (ImportState) claiming step S
//   wait                          print "OK wait" and block until a line or the end of stdin
//   detach                        dos_detach the attached session
//   rpc_save:id=I[,path=P]        SaveCheckpoint by session id (operator call)
//   rpc_load:id=I,path=P          LoadCheckpoint by session id, no token
//   rpc_policy:id=I,policy=P      SetPolicy of session I, no token
//   rpc_detach:id=I[,token=T]     Detach by id
//   rpc_export:id=I[,token=T]     ExportState of tensor 0 (buffer name "x")
//   rpc_import:id=I[,token=T]     ImportState of tensor 0 (buffer name "x")
//   rpc_stats[:id=I]              GetStats
//   rpc_list                      ListSessions (prints the count)
//   rpc_delete:path=P[,uid=U]     DeleteCheckpoint (uid: another's folder, operators only)
//   fd_empty                      an empty message on the descriptor socket; prints dosd's answer
//   connect:n=N                   N idle connections to the gRPC socket, held until exit
//   rpc_attach:name=N[,n=K,keep=1] K raw Attach calls claiming this process's pid (keep=1:
//                                 go on after a refusal)
//   rpc_resume:id=I,token=T       raw Attach resuming session I with token T
//   hold_blocks:n=N               N times: raw Attach, fetch and map the control block, Detach,
//                                 keeping every mapping until exit (prints held=K and the
//                                 first refusal)
// `id=self` names the session this process attached. Exit status: 0 when every line was printed
// (whatever each op answered), 2 on bad usage.
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "dos/dos.h"
#include "dos/wire/control_block.h"
#include "dos/wire/fd_protocol.h"
#include "proto/dos/v1/dos.grpc.pb.h"

namespace {

using Args = std::map<std::string, std::string>;

struct Op {
  std::string name;
  Args args;
};

Op ParseOp(const std::string& text) {
  Op op;
  const size_t colon = text.find(':');
  op.name = text.substr(0, colon);
  if (colon == std::string::npos) return op;
  for (absl::string_view kv : absl::StrSplit(text.substr(colon + 1), ',', absl::SkipEmpty())) {
    const size_t eq = kv.find('=');
    op.args[std::string(kv.substr(0, eq))] =
        eq == absl::string_view::npos ? "" : std::string(kv.substr(eq + 1));
  }
  return op;
}

uint64_t U64(const Args& a, const std::string& key, uint64_t def = 0) {
  auto it = a.find(key);
  uint64_t v = def;
  if (it != a.end() && !absl::SimpleAtoi(it->second, &v)) v = def;
  return v;
}

std::string Str(const Args& a, const std::string& key, const std::string& def = "") {
  auto it = a.find(key);
  return it == a.end() ? def : it->second;
}

void Print(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void PrintRpc(const std::string& op, const grpc::Status& st, const std::string& extra = "") {
  if (st.ok()) {
    Print(absl::StrCat("OK ", op, extra.empty() ? "" : " ", extra));
  } else {
    std::string msg = st.error_message();
    for (char& c : msg) c = c == '\n' ? ' ' : c;
    Print(absl::StrCat("ERR ", op, " code=", static_cast<int>(st.error_code()),
                       extra.empty() ? "" : " ", extra, " msg=", msg));
  }
}

void PrintDos(const std::string& op, dos_status st, const std::string& extra = "") {
  if (st == DOS_OK) {
    Print(absl::StrCat("OK ", op, extra.empty() ? "" : " ", extra));
  } else {
    Print(absl::StrCat("ERR ", op, " code=", static_cast<int>(st), " msg=", dos_last_error()));
  }
}

uint64_t SessionId(const Args& a, dos_session* session) {
  if (Str(a, "id") == "self") return session != nullptr ? dos_session_id(session) : 0;
  return U64(a, "id");
}

std::string Token(const Args& a, dos_session* session) {
  if (Str(a, "token") == "self") return session != nullptr ? dos_session_token(session) : "";
  return Str(a, "token");
}

std::unique_ptr<grpc::ClientContext> Context() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  return ctx;
}

// hold_blocks: sessions closed while this process keeps mapping their
// control blocks (never unmapped: the process's exit does it).
void HoldBlocks(dos::v1::Dos::Stub* stub, const std::string& socket, uint64_t n) {
  grpc::Status st;
  uint64_t held = 0;
  for (uint64_t k = 0; k < n; ++k) {
    dos::v1::AttachRequest req;
    req.set_client_name("hold");
    req.set_pid(static_cast<int32_t>(::getpid()));
    req.set_protocol_version(dos::kProtocolVersion);
    absl::StatusOr<std::string> ticket = dos::fdproto::Hello(dos::fdproto::SocketPathFor(socket));
    if (ticket.ok()) req.set_fd_ticket(*ticket);
    dos::v1::AttachResponse resp;
    st = stub->Attach(Context().get(), req, &resp);
    if (!st.ok()) break;
    auto block = dos::fdproto::FetchControlBlock(
        dos::fdproto::SocketPathFor(socket), resp.session().session_id(), resp.session().token());
    struct stat info {};
    if (!block.ok() || ::fstat(block->memfd.get(), &info) != 0) {
      st = grpc::Status(grpc::StatusCode::INTERNAL,
                        block.ok() ? "fstat failed" : std::string(block.status().message()));
      break;
    }
    if (::mmap(nullptr, static_cast<size_t>(info.st_size), PROT_READ | PROT_WRITE, MAP_SHARED,
               block->memfd.get(), 0) == MAP_FAILED) {
      st = grpc::Status(grpc::StatusCode::INTERNAL, "mmap failed");
      break;
    }
    dos::v1::DetachRequest detach;
    *detach.mutable_session() = resp.session();
    dos::v1::DetachResponse detached;
    st = stub->Detach(Context().get(), detach, &detached);
    if (!st.ok()) break;
    ++held;
  }
  PrintRpc("hold_blocks", st, absl::StrCat("held=", held));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: sec_client SOCKET|tcp:HOST:PORT OP...\n");
    return 2;
  }
  const std::string target = argv[1];
  const bool tcp = target.rfind("tcp:", 0) == 0;
  const std::string socket = tcp ? "" : target;
  std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(
      tcp ? target.substr(4) : "unix:" + target, grpc::InsecureChannelCredentials());
  std::unique_ptr<dos::v1::Dos::Stub> stub = dos::v1::Dos::NewStub(channel);

  dos_session* session = nullptr;
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  dos_step_args stalled;  // `stall`'s early step, for `verdict`
  dos_step_args_init(&stalled);
  for (int i = 2; i < argc; ++i) {
    const Op op = ParseOp(argv[i]);
    const Args& a = op.args;
    if (op.name == "attach") {
      dos_attach_options o;
      dos_attach_options_init(&o);
      o.socket_path = socket.c_str();
      const std::string name = Str(a, "name", "sec");
      o.client_name = name.c_str();
      o.rank = static_cast<int32_t>(std::stoi(Str(a, "rank", "-1")));
      o.world_size = o.rank >= 0 ? o.rank + 1 : 1;
      dos_status st = dos_attach(&o, &session);
      PrintDos("attach", st,
               st == DOS_OK ? absl::StrCat("id=", dos_session_id(session),
                                           " token=", dos_session_token(session))
                            : "");
    } else if (op.name == "register") {
      const uint64_t n = U64(a, "numel", 1024);
      void* p = nullptr;
      void* g = nullptr;
      dos_status st = dos_buffer_alloc(session, n * 4, &p);
      if (st == DOS_OK) st = dos_buffer_alloc(session, n * 4, &g);
      if (st == DOS_OK) {
        for (uint64_t k = 0; k < n; ++k) {
          static_cast<float*>(p)[k] = 1.0f;
          static_cast<float*>(g)[k] = 0.5f;
        }
        dos_tensor t{"w", DOS_DTYPE_F32, p, DOS_DTYPE_F32, g, n, 0};
        dos_register_options ro{U64(a, "subgroup", 0)};
        st = dos_register(session, &t, 1, &h, 1, &ro);
      }
      int64_t step = -1;
      if (st == DOS_OK) dos_state_read(session, 0, nullptr, nullptr, nullptr, &step);
      PrintDos("register", st, st == DOS_OK ? absl::StrCat("step=", step) : "");
    } else if (op.name == "step") {
      dos_step_args sa;
      dos_step_args_init(&sa);
      sa.groups = &h;
      sa.num_groups = 1;
      dos_step_result r{};
      dos_status st = DOS_OK;
      const uint64_t n = U64(a, "n", 1);
      if (U64(a, "bad") != 0) {
        sa.grad_scale = -1;
        uint64_t failed = 0;
        for (uint64_t k = 0; k < n; ++k) failed += dos_step(session, &sa, &r) != DOS_OK ? 1 : 0;
        Print(absl::StrCat("OK step failed=", failed));
        continue;
      }
      for (uint64_t k = 0; k < n && st == DOS_OK; ++k) st = dos_step(session, &sa, &r);
      PrintDos("step", st, st == DOS_OK ? absl::StrCat("step=", r.step) : "");
    } else if (op.name == "stall") {
      stalled.groups = &h;
      stalled.num_groups = 1;
      dos_step_result r{};
      dos_status st = dos_step(session, &stalled, &r);
      if (st == DOS_OK) st = dos_step_begin_early(session, &stalled, 0, nullptr);
      bool held = false;
      for (int k = 0; st == DOS_OK && !held && k < 1000; ++k) {
        dos::v1::GetStatsResponse resp;
        if (stub->GetStats(Context().get(), dos::v1::GetStatsRequest(), &resp).ok()) {
          for (const auto& u : resp.uids()) held |= u.uid() == ::getuid() && u.early_steps() > 0;
        }
        if (!held) ::usleep(10'000);
      }
      PrintDos("stall", st, absl::StrCat("held=", held ? 1 : 0));
    } else if (op.name == "verdict") {
      dos_status st = dos_step_verdict(session, &stalled, nullptr);
      dos_step_result r{};
      if (st == DOS_OK) st = dos_step_wait(session, 30000, &r);
      PrintDos("verdict", st, st == DOS_OK ? absl::StrCat("step=", r.step) : "");
    } else if (op.name == "many") {
      const uint64_t n = U64(a, "n", 1);
      const uint64_t numel = U64(a, "numel", 256);
      static std::vector<dos_session*> extra;
      dos_status st = DOS_OK;
      uint64_t done = 0;
      for (; done < n && st == DOS_OK; ++done) {
        dos_attach_options o;
        dos_attach_options_init(&o);
        o.socket_path = socket.c_str();
        o.client_name = "many";
        dos_session* m = nullptr;
        st = dos_attach(&o, &m);
        void* p = nullptr;
        void* g = nullptr;
        if (st == DOS_OK) st = dos_buffer_alloc(m, numel * 4, &p);
        if (st == DOS_OK) st = dos_buffer_alloc(m, numel * 4, &g);
        if (st == DOS_OK) {
          dos_tensor t{"w", DOS_DTYPE_F32, p, DOS_DTYPE_F32, g, numel, 0};
          st = dos_register(m, &t, 1, &h, 1, nullptr);
        }
        if (m != nullptr) extra.push_back(m);
      }
      PrintDos("many", st, absl::StrCat("sessions=", st == DOS_OK ? done : done - 1));
    } else if (op.name == "state_write") {
      int64_t step = 0;
      absl::SimpleAtoi(Str(a, "step", "0"), &step);
      int64_t cur = 0;
      dos_status st = dos_state_read(session, 0, nullptr, nullptr, nullptr, &cur);
      std::vector<float> v(static_cast<size_t>(U64(a, "numel", 1024)), 0.25f);
      if (st == DOS_OK) st = dos_state_write(session, 0, v.data(), v.data(), v.data(), step);
      PrintDos("state_write", st);
    } else if (op.name == "wait") {
      Print("OK wait");
      char c;
      while (::read(STDIN_FILENO, &c, 1) > 0 && c != '\n') {
      }
    } else if (op.name == "detach") {
      PrintDos("detach", dos_detach(session));
      session = nullptr;
    } else if (op.name == "rpc_save") {
      dos::v1::SaveCheckpointRequest req;
      req.set_session_id(SessionId(a, session));
      req.set_path(Str(a, "path"));
      dos::v1::SaveCheckpointResponse resp;
      grpc::Status st = stub->SaveCheckpoint(Context().get(), req, &resp);
      PrintRpc("rpc_save", st, absl::StrCat("path=", resp.path()));
    } else if (op.name == "rpc_load") {
      dos::v1::LoadCheckpointRequest req;
      req.mutable_session()->set_session_id(SessionId(a, session));
      req.mutable_session()->set_token(Token(a, session));
      req.set_path(Str(a, "path"));
      dos::v1::LoadCheckpointResponse resp;
      PrintRpc("rpc_load", stub->LoadCheckpoint(Context().get(), req, &resp));
    } else if (op.name == "rpc_delete") {
      dos::v1::DeleteCheckpointRequest req;
      req.set_path(Str(a, "path"));
      if (a.count("uid") != 0) req.set_uid(static_cast<uint32_t>(U64(a, "uid")));
      dos::v1::DeleteCheckpointResponse resp;
      const grpc::Status st = stub->DeleteCheckpoint(Context().get(), req, &resp);
      PrintRpc("rpc_delete", st,
               absl::StrCat("files=", resp.paths_size(), " bytes=", resp.bytes(),
                            " uid_bytes=", resp.usage().bytes()));
    } else if (op.name == "connect") {
      // Idle connections to the gRPC socket, held until the process ends.
      static std::vector<dos::UniqueFd> held;
      uint64_t opened = 0;
      for (uint64_t k = 0; k < U64(a, "n", 1); ++k) {
        dos::UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::memcpy(addr.sun_path, socket.data(), std::min(socket.size(), sizeof addr.sun_path - 1));
        if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) ++opened;
        held.push_back(std::move(s));
      }
      Print(absl::StrCat("OK connect opened=", opened));
    } else if (op.name == "fd_empty") {
      // An empty message on the descriptor socket: dosd answers what is wrong.
      dos::UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      const std::string path = dos::fdproto::SocketPathFor(socket);
      std::memcpy(addr.sun_path, path.data(), std::min(path.size(), sizeof addr.sun_path - 1));
      absl::Status st;
      if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        st = absl::UnavailableError(std::strerror(errno));
      } else {
        st = dos::fdproto::SendMessage(s.get(), "", 0, {});
      }
      alignas(dos::fdproto::Reply) char buf[sizeof(dos::fdproto::Reply)];
      std::vector<dos::UniqueFd> fds;
      absl::StatusOr<size_t> n = st.ok() ? dos::fdproto::ReceiveMessage(s.get(), buf, sizeof buf,
                                                                        &fds)
                                         : absl::StatusOr<size_t>(st);
      absl::StatusOr<dos::fdproto::Reply> r =
          n.ok() ? dos::fdproto::ParseReply(buf, *n, fds.size()) : n.status();
      if (r.ok() && r->status_code != 0) {
        r = absl::Status(static_cast<absl::StatusCode>(r->status_code),
                         dos::fdproto::ReplyText(*r));
      }
      PrintRpc("fd_empty", r.ok() ? grpc::Status::OK
                                  : grpc::Status(static_cast<grpc::StatusCode>(r.status().code()),
                                                 std::string(r.status().message())));
    } else if (op.name == "rpc_policy") {
      dos::v1::SetPolicyRequest req;
      req.mutable_session()->set_session_id(SessionId(a, session));
      req.mutable_session()->set_token(Token(a, session));
      req.set_policy(Str(a, "policy", "cpu"));
      dos::v1::SetPolicyResponse resp;
      PrintRpc("rpc_policy", stub->SetPolicy(Context().get(), req, &resp));
    } else if (op.name == "rpc_detach") {
      dos::v1::DetachRequest req;
      req.mutable_session()->set_session_id(SessionId(a, session));
      req.mutable_session()->set_token(Token(a, session));
      dos::v1::DetachResponse resp;
      PrintRpc("rpc_detach", stub->Detach(Context().get(), req, &resp));
    } else if (op.name == "rpc_export" || op.name == "rpc_import") {
      dos::v1::TransferStateRequest req;
      req.mutable_session()->set_session_id(SessionId(a, session));
      req.mutable_session()->set_token(Token(a, session));
      req.mutable_buffer()->set_name(Str(a, "buffer", "/x"));
      req.set_step(static_cast<int64_t>(U64(a, "step", 0)));
      dos::v1::TransferStateResponse resp;
      grpc::Status st = op.name == "rpc_export"
                            ? stub->ExportState(Context().get(), req, &resp)
                            : stub->ImportState(Context().get(), req, &resp);
      PrintRpc(op.name, st);
    } else if (op.name == "rpc_stats") {
      dos::v1::GetStatsRequest req;
      req.set_session_id(SessionId(a, session));
      dos::v1::GetStatsResponse resp;
      grpc::Status st = stub->GetStats(Context().get(), req, &resp);
      PrintRpc("rpc_stats", st, absl::StrCat("sessions=", resp.sessions_size()));
    } else if (op.name == "rpc_list") {
      dos::v1::ListSessionsRequest req;
      dos::v1::ListSessionsResponse resp;
      grpc::Status st = stub->ListSessions(Context().get(), req, &resp);
      PrintRpc("rpc_list", st, absl::StrCat("sessions=", resp.sessions_size()));
    } else if (op.name == "hold_blocks") {
      HoldBlocks(stub.get(), socket, U64(a, "n", 1));
    } else if (op.name == "rpc_attach" || op.name == "rpc_resume") {
      dos::v1::AttachRequest req;
      req.set_client_name(Str(a, "name", "sec"));
      req.set_pid(static_cast<int32_t>(::getpid()));
      req.set_protocol_version(dos::kProtocolVersion);
      if (op.name == "rpc_resume") {
        req.mutable_resume()->set_session_id(SessionId(a, session));
        req.mutable_resume()->set_token(Token(a, session));
      }
      dos::v1::AttachResponse resp;
      grpc::Status st;
      uint64_t ok = 0;
      uint64_t failed = 0;
      const uint64_t n = U64(a, "n", 1);
      const bool keep_going = U64(a, "keep") != 0;
      for (uint64_t k = 0; k < n; ++k) {
        resp.Clear();
        // Like the client library: the kernel's word for who we are first
        // (a ticket per Attach; none over TCP).
        if (!tcp) {
          absl::StatusOr<std::string> ticket =
              dos::fdproto::Hello(dos::fdproto::SocketPathFor(socket));
          if (ticket.ok()) req.set_fd_ticket(*ticket);
        }
        grpc::Status one = stub->Attach(Context().get(), req, &resp);
        if (one.ok()) {
          ++ok;
        } else {
          ++failed;
          st = one;
          if (!keep_going) break;
        }
      }
      PrintRpc(op.name, st,
               absl::StrCat("id=", resp.session().session_id(), " attached=", ok,
                            " failed=", failed));
    } else {
      std::fprintf(stderr, "sec_client: unknown op %s\n", op.name.c_str());
      return 2;
    }
  }
  if (session != nullptr) dos_detach(session);
  return 0;
}
