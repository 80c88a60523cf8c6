// bounds_client: a victim trainer that times what it does, or an attacker
// trying to starve the other users of dosd (issue 24), for bounds_test.cc;
// run as a throwaway user by the security fixture. It performs the
// operations on its command line in order and prints one line per operation:
//
//   OK <op> key=value ... ms=<time the op took>   or   ERR <op> code=<absl code> msg=<text>
//
// Usage: bounds_client SOCKET OP...
//  Victim (one session):
//   attach                       dos_attach
//   register[:numel=K]           one bf16 tensor in dos_buffer_alloc memory
//   step[:n=K]                   K steps
//   save                         SaveCheckpoint of our session (by id, as its owner)
//   state_read                   dos_state_read of tensor 0
//  Attacker (each op attaches sessions of its own, kept until exit):
//   sparse:segments=N,bytes=B    send N sealed, sparse (never touched) memfds of B bytes into
//                                one session; prints accepted= and the first refusal
//   idle:n=N                     open N descriptor-socket connections and send nothing
//   stall:n=N                    N sessions, each registered and with an early step without
//                                a verdict whose subgroups are never marked ready
//   tensors:sessions=S,n=N       S sessions registering N one-element tensors each
//   names:sessions=S,bytes=B     S sessions registering one tensor named with B bytes
//   all                          print "OK all" (a marker between ops)
//   wait                         print "OK wait", block until stdin closes
// Attacker ops print registered=/refused= counts and the first refusal's message.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "dos/dos.h"
#include "dos/wire/fd_protocol.h"
#include "dos/wire/shm_segment.h"
#include "proto/dos/v1/dos.grpc.pb.h"

namespace {

using Args = std::map<std::string, std::string>;
using Clock = std::chrono::steady_clock;

uint64_t U64(const Args& a, const std::string& k, uint64_t def) {
  auto it = a.find(k);
  uint64_t v = def;
  if (it != a.end() && !absl::SimpleAtoi(it->second, &v)) v = def;
  return v;
}

std::string OneLine(absl::string_view text) {
  std::string s(text.substr(0, 600));
  for (char& c : s) c = (c == '\n' || c == ' ') ? '_' : c;
  return s;
}

absl::Status FromDos(dos_status s, const char* what) {
  if (s == DOS_OK) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s), absl::StrCat(what, ": ", dos_last_error()));
}

// One session with one bf16 tensor (or `n` one-element tensors), in buffers
// dosd maps.
struct Session {
  dos_session* s = nullptr;
  dos_hparams h;
  uint64_t numel = 0;
  ~Session() {
    if (s != nullptr) dos_detach(s);
  }
};

absl::Status Attach(const std::string& socket, Session* t) {
  dos_attach_options o;
  dos_attach_options_init(&o);
  o.socket_path = socket.c_str();
  o.client_name = "bounds_client";
  o.timeout_ms = 10000;
  return FromDos(dos_attach(&o, &t->s), "attach");
}

// `n` tensors of `numel` elements each, named `name` (the same for all).
absl::Status Register(Session* t, uint64_t n, uint64_t numel, const std::string& name) {
  void* param = nullptr;
  void* grad = nullptr;
  const uint64_t total = n * numel;
  if (absl::Status st = FromDos(dos_buffer_alloc(t->s, total * 2, &param), "buffer_alloc");
      !st.ok()) {
    return st;
  }
  if (absl::Status st = FromDos(dos_buffer_alloc(t->s, total * 2, &grad), "buffer_alloc");
      !st.ok()) {
    return st;
  }
  for (uint64_t i = 0; i < total; ++i) {
    static_cast<uint16_t*>(param)[i] = 0x3f80;
    static_cast<uint16_t*>(grad)[i] = 0x3f00;
  }
  std::vector<dos_tensor> tensors(n);
  for (uint64_t i = 0; i < n; ++i) {
    tensors[i] = dos_tensor{name.c_str(), DOS_DTYPE_BF16, static_cast<uint16_t*>(param) + i * numel,
                            DOS_DTYPE_BF16, static_cast<uint16_t*>(grad) + i * numel, numel, 0};
  }
  dos_hparams_init_adamw(&t->h);
  t->numel = total;
  return FromDos(dos_register(t->s, tensors.data(), static_cast<uint32_t>(n), &t->h, 1, nullptr),
                 "register");
}

struct Client {
  std::string socket;
  Session victim;
  std::vector<std::unique_ptr<Session>> held;  // the attacker's sessions
  std::vector<dos::UniqueFd> idle;             // the attacker's idle connections
};

// Attaches and registers `sessions` sessions with `n` tensors named `name`;
// "registered=K refused=R first=<message>".
std::string RegisterMany(Client* c, uint64_t sessions, uint64_t n, const std::string& name) {
  uint64_t registered = 0, refused = 0;
  std::string first;
  for (uint64_t i = 0; i < sessions; ++i) {
    auto t = std::make_unique<Session>();
    absl::Status st = Attach(c->socket, t.get());
    if (st.ok()) st = Register(t.get(), n, 1, name);
    if (st.ok()) {
      ++registered;
    } else {
      ++refused;
      if (first.empty()) {
        first = absl::StrCat("code", static_cast<int>(st.code()), ":", st.message());
      }
    }
    c->held.push_back(std::move(t));  // kept: a refused one still holds its session
  }
  return absl::StrCat("registered=", registered, " refused=", refused, " first=", OneLine(first));
}

absl::StatusOr<std::string> Sparse(Client* c, uint64_t segments, uint64_t bytes) {
  auto t = std::make_unique<Session>();
  if (absl::Status st = Attach(c->socket, t.get()); !st.ok()) return st;
  const std::string fd_socket = dos::fdproto::SocketPathFor(c->socket);
  uint64_t accepted = 0;
  std::string first;
  for (uint64_t i = 0; i < segments; ++i) {
    dos::UniqueFd fd(memfd_create("bounds_client", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fd.valid() || ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0 ||
        fcntl(fd.get(), F_ADD_SEALS, dos::ShmSegment::kRequiredSeals) != 0) {
      return absl::InternalError(absl::StrCat("memfd of ", bytes, " bytes: ", strerror(errno)));
    }
    const int raw = fd.get();
    auto ids = dos::fdproto::SendSegments(fd_socket, dos_session_id(t->s), dos_session_token(t->s),
                                          {&raw, 1}, absl::Seconds(10));
    if (ids.ok()) {
      ++accepted;
    } else if (first.empty()) {
      first = absl::StrCat("code", static_cast<int>(ids.status().code()), ":",
                           ids.status().message());
    }
  }
  c->held.push_back(std::move(t));
  return absl::StrCat("accepted=", accepted, " first=", OneLine(first));
}

std::string Idle(Client* c, uint64_t n) {
  const std::string path = dos::fdproto::SocketPathFor(c->socket);
  uint64_t open = 0;
  for (uint64_t i = 0; i < n; ++i) {
    dos::UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) ++open;
    c->idle.push_back(std::move(s));
  }
  return absl::StrCat("open=", open);
}

// Sessions whose early step (no verdict) waits for subgroups never marked.
std::string Stall(Client* c, uint64_t n) {
  uint64_t begun = 0;
  std::string first;
  for (uint64_t i = 0; i < n; ++i) {
    auto t = std::make_unique<Session>();
    absl::Status st = Attach(c->socket, t.get());
    if (st.ok()) st = Register(t.get(), 1, 4096, "w");
    if (st.ok()) {
      dos_step_args args;
      dos_step_args_init(&args);
      args.groups = &t->h;
      args.num_groups = 1;
      st = FromDos(dos_step_begin_early(t->s, &args, DOS_EARLY_NO_VERDICT, nullptr), "begin_early");
    }
    if (st.ok()) {
      ++begun;
    } else if (first.empty()) {
      first = std::string(st.message());
    }
    c->held.push_back(std::move(t));
  }
  return absl::StrCat("begun=", begun, " first=", OneLine(first));
}

// State-memory requests (state_dict()'s views) of each stalled session, one
// thread a session, for `seconds` (at least once each): each once held the
// descriptor socket's one thread, and every other user's attach, until the
// session's gate refused it; "aborted=K reads=N ms=<slowest>".
std::string StalledReads(Client* c, double seconds) {
  // dosd's step threads take the stalled steps' sessions first.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::atomic<uint64_t> aborted{0}, reads{0};
  std::mutex mu;
  double slowest = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::thread> threads;
  for (const auto& t : c->held) {
    threads.emplace_back([&, s = t->s] {
      do {
        const auto t0 = std::chrono::steady_clock::now();
        uint32_t moment = 0;
        if (dos_state_views_fetch(s, nullptr, &moment) == DOS_ABORTED) aborted.fetch_add(1);
        reads.fetch_add(1);
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        std::lock_guard<std::mutex> lock(mu);
        slowest = std::max(slowest, ms);
      } while (std::chrono::steady_clock::now() < end);
    });
  }
  for (std::thread& t : threads) t.join();
  return absl::StrCat("aborted=", aborted.load(), " reads=", reads.load(), " ms=", slowest);
}

absl::StatusOr<std::string> Victim(Client* c, const std::string& name, const Args& a) {
  Session& v = c->victim;
  if (name == "attach") {
    if (absl::Status st = Attach(c->socket, &v); !st.ok()) return st;
    return absl::StrCat("id=", dos_session_id(v.s));
  }
  if (name == "register") {
    if (absl::Status st = Register(&v, 1, U64(a, "numel", 4096), "w"); !st.ok()) return st;
    return std::string();
  }
  if (name == "step") {
    dos_step_args args;
    dos_step_args_init(&args);
    args.groups = &v.h;
    args.num_groups = 1;
    dos_step_result r{};
    for (uint64_t i = 0, n = U64(a, "n", 1); i < n; ++i) {
      if (absl::Status st = FromDos(dos_step(v.s, &args, &r), "step"); !st.ok()) return st;
    }
    return absl::StrCat("step=", r.step);
  }
  if (name == "state_read") {
    std::vector<float> m(v.numel);
    int64_t step = 0;
    if (absl::Status st = FromDos(dos_state_read(v.s, 0, m.data(), nullptr, nullptr, &step),
                                  "state_read");
        !st.ok()) {
      return st;
    }
    return absl::StrCat("step=", step);
  }
  if (name == "save") {
    if (v.s == nullptr) return absl::FailedPreconditionError("attach first");
    auto stub = dos::v1::Dos::NewStub(
        grpc::CreateChannel("unix:" + c->socket, grpc::InsecureChannelCredentials()));
    dos::v1::SaveCheckpointRequest req;
    req.set_session_id(dos_session_id(v.s));
    dos::v1::SaveCheckpointResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status st = stub->SaveCheckpoint(&ctx, req, &resp);
    if (!st.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
    }
    return absl::StrCat("path=", resp.path());
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown op ", name));
}

absl::StatusOr<std::string> Run(Client* c, const std::string& name, const Args& a) {
  if (name == "sparse") return Sparse(c, U64(a, "segments", 1), U64(a, "bytes", 4096));
  if (name == "idle") return Idle(c, U64(a, "n", 1));
  if (name == "stall") return Stall(c, U64(a, "n", 1));
  if (name == "stalled_reads") return StalledReads(c, static_cast<double>(U64(a, "seconds", 0)));
  if (name == "tensors") {
    return RegisterMany(c, U64(a, "sessions", 1), U64(a, "n", 1), "t");
  }
  if (name == "names") {
    return RegisterMany(c, U64(a, "sessions", 1), 1, std::string(U64(a, "bytes", 1), 'n'));
  }
  if (name == "all") return std::string();
  if (name == "wait") {
    std::printf("OK wait\n");
    std::fflush(stdout);
    char ch;
    while (read(0, &ch, 1) > 0) {
    }
    return std::string("done=1");
  }
  return Victim(c, name, a);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: bounds_client SOCKET OP...\n");
    return 2;
  }
  Client c;
  c.socket = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string text = argv[i];
    const size_t colon = text.find(':');
    const std::string name = text.substr(0, colon);
    Args a;
    if (colon != std::string::npos) {
      for (absl::string_view kv : absl::StrSplit(text.substr(colon + 1), ',')) {
        const size_t eq = kv.find('=');
        a[std::string(kv.substr(0, eq))] =
            eq == absl::string_view::npos ? "" : std::string(kv.substr(eq + 1));
      }
    }
    const Clock::time_point start = Clock::now();
    absl::StatusOr<std::string> r = Run(&c, name, a);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (r.ok()) {
      std::printf("OK %s %s%sms=%.1f\n", name.c_str(), r->c_str(), r->empty() ? "" : " ", ms);
    } else {
      std::printf("ERR %s code=%d ms=%.1f msg=%s\n", name.c_str(),
                  static_cast<int>(r.status().code()), ms, OneLine(r.status().message()).c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}
