// mem_client: a trainer (or an attacker posing as one) for the memory
// isolation tests (memory_test.cc), run as a throwaway user by the security
// fixture. It performs the operations on its command line in order and
// prints one line per operation:
//
//   OK <op> key=value ...        or        ERR <op> code=<absl code> msg=<text>
//
// Usage: mem_client SOCKET OP...
//   attach                       dos_attach; prints id= token=
//   register[:numel=K]           one bf16 tensor in dos_buffer_alloc memory
//   step[:n=K]                   K steps
//   state_read                   dos_state_read of tensor 0 (ExportState)
//   truncate_own                 ftruncate every memfd of this process to 0;
//                                prints total= eperm=
//   control:id=I,token=T         fetch session I's control block
//   inject:id=I,token=T          send a sealed memfd into session I
//   send_unsealed                send an unsealed memfd into our own session
//   send_file                    send a regular file's descriptor likewise
//   register_name:name=N         raw RegisterShard naming shm object N
//   export_name:name=N           raw ExportState into shm object N
//   export_truncate              send a sealed memfd for tensor 0's state, ftruncate it to
//                                0 (as dosd holds it), then ExportState into it; prints
//                                eperm= step=
//   open_devshm                  try to open every /dev/shm/dos* object
//                                read-write; prints opened=
//   raw_step[:field=F,value=V]   write a step request into our own control block by hand
//                                (a valid one, then F = V: lr, grad_scale, clip_coef, eps as
//                                doubles, nan/inf/-inf allowed; num_groups, flags, lease,
//                                budget, peak as integers), ring it and wait for the result;
//                                prints seq= step= (ERR with dosd's code and message)
//   early_stall                  begin an early step by hand (kStepGradientsPending) and send
//                                no verdict; prints seq=
//   raw_wait[:timeout_s=S]       wait for the result of the last raw request (default 60 s)
//   wait                         print "OK wait", block until stdin closes
// Exit status 0 when every line was printed, 2 on bad usage.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "dos/dos.h"
#include "dos/wire/control_block.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/fd_protocol.h"
#include "dos/wire/shm_segment.h"
#include "proto/dos/v1/dos.grpc.pb.h"

namespace {

using Args = std::map<std::string, std::string>;

void Ok(const std::string& op, const std::string& rest = "") {
  std::printf("OK %s%s%s\n", op.c_str(), rest.empty() ? "" : " ", rest.c_str());
  std::fflush(stdout);
}
void Err(const std::string& op, const absl::Status& s) {
  std::string msg(s.message());
  for (char& c : msg) c = c == '\n' ? ' ' : c;
  std::printf("ERR %s code=%d msg=%s\n", op.c_str(), static_cast<int>(s.code()), msg.c_str());
  std::fflush(stdout);
}
absl::Status FromDos(dos_status s, const char* what) {
  if (s == DOS_OK) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s),
                      absl::StrCat(what, ": ", dos_last_error()));
}
uint64_t U64(const Args& a, const std::string& k, uint64_t def) {
  auto it = a.find(k);
  uint64_t v = def;
  if (it != a.end() && !absl::SimpleAtoi(it->second, &v)) v = def;
  return v;
}
std::string Str(const Args& a, const std::string& k) {
  auto it = a.find(k);
  return it == a.end() ? "" : it->second;
}

struct Trainer {
  std::string socket;
  dos_session* s = nullptr;
  dos_hparams h;
  uint64_t numel = 0;
  // Our own control block, mapped a second time to write it by hand.
  std::unique_ptr<dos::ShmSegment> block;
  dos::UniqueFd block_connection;
  uint32_t raw_seq = 0;
};

// Our session's control block, fetched as the library fetches it.
absl::StatusOr<dos::ControlBlock*> OwnBlock(Trainer* t) {
  if (t->s == nullptr) return absl::FailedPreconditionError("attach first");
  if (t->block == nullptr) {
    auto cb = dos::fdproto::FetchControlBlock(dos::fdproto::SocketPathFor(t->socket),
                                              dos_session_id(t->s), dos_session_token(t->s));
    if (!cb.ok()) return cb.status();
    auto seg = dos::ShmSegment::Adopt(std::move(cb->memfd), "control block");
    if (!seg.ok()) return seg.status();
    t->block = *std::move(seg);
    t->block_connection = std::move(cb->connection);
  }
  return static_cast<dos::ControlBlock*>(t->block->data());
}

// A valid request for our one group, then `field` = `value` as a hostile
// trainer would write it.
absl::Status WriteRequest(dos::StepRequest& r, const std::string& field,
                          const std::string& value) {
  r.flags = 0;
  r.num_groups = 1;
  r.grad_scale = 1;
  r.clip_coef = 1;
  r.groups[0] = dos::GroupStepParams{1e-3, 0.9, 0.999, 1e-8, 0.01};
  if (field.empty()) return absl::OkStatus();
  const double d = std::strtod(value.c_str(), nullptr);
  uint64_t u = 0;
  const bool is_int = absl::SimpleAtoi(value, &u);
  if (field == "lr") r.groups[0].lr = d;
  else if (field == "eps") r.groups[0].eps = d;
  else if (field == "grad_scale") r.grad_scale = d;
  else if (field == "clip_coef") r.clip_coef = d;
  else if (!is_int) return absl::InvalidArgumentError("integer field, integer value");
  else if (field == "num_groups") r.num_groups = static_cast<uint32_t>(u);
  else if (field == "flags") r.flags = static_cast<uint32_t>(u);
  else if (field == "lease") r.gpu_lease_bytes = u;
  else if (field == "budget") r.gpu_budget_bytes = u;
  else if (field == "peak") r.gpu_peak_bytes = u;
  else return absl::InvalidArgumentError(absl::StrCat("unknown field ", field));
  if (field == "lease" || field == "budget" || field == "peak") r.flags |= dos::kStepGpuLease;
  return absl::OkStatus();
}

absl::Status RawWait(Trainer* t, const std::string& op, absl::Duration timeout) {
  auto block = OwnBlock(t);
  if (!block.ok()) return block.status();
  dos::ControlBlockChannel channel(*block);
  if (absl::Status st = channel.WaitResult(t->raw_seq, timeout); !st.ok()) return st;
  const dos::StepResult& res = (*block)->result;
  if (res.status_code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(res.status_code),
                        std::string(res.message, strnlen(res.message, dos::kMaxStatusMessage)));
  }
  Ok(op, absl::StrCat("seq=", res.seq, " step=", res.step));
  return absl::OkStatus();
}

absl::Status Register(Trainer* t, uint64_t numel) {
  void* param = nullptr;
  void* grad = nullptr;
  if (absl::Status st = FromDos(dos_buffer_alloc(t->s, numel * 2, &param), "buffer_alloc");
      !st.ok()) {
    return st;
  }
  if (absl::Status st = FromDos(dos_buffer_alloc(t->s, numel * 2, &grad), "buffer_alloc");
      !st.ok()) {
    return st;
  }
  for (uint64_t i = 0; i < numel; ++i) {
    static_cast<uint16_t*>(param)[i] = 0x3f80;
    static_cast<uint16_t*>(grad)[i] = 0x3f00;
  }
  dos_tensor tensor{"w", DOS_DTYPE_BF16, param, DOS_DTYPE_BF16, grad, numel, 0};
  dos_hparams_init_adamw(&t->h);
  t->numel = numel;
  return FromDos(dos_register(t->s, &tensor, 1, &t->h, 1, nullptr), "register");
}

// A sealed (or not) memfd of one page.
dos::UniqueFd Memfd(bool sealed) {
  dos::UniqueFd fd(memfd_create("mem_client", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (ftruncate(fd.get(), 4096) != 0) return dos::UniqueFd();
  if (sealed) fcntl(fd.get(), F_ADD_SEALS, dos::ShmSegment::kRequiredSeals);
  return fd;
}

std::unique_ptr<dos::v1::Dos::Stub> Stub(const std::string& socket) {
  return dos::v1::Dos::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
}
absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::Status Run(Trainer* t, const std::string& name, const Args& a) {
  const std::string fd_socket = dos::fdproto::SocketPathFor(t->socket);
  if (name == "attach") {
    dos_attach_options o;
    dos_attach_options_init(&o);
    o.socket_path = t->socket.c_str();
    o.client_name = "mem_client";
    if (absl::Status st = FromDos(dos_attach(&o, &t->s), "attach"); !st.ok()) return st;
    Ok(name, absl::StrCat("id=", dos_session_id(t->s), " token=", dos_session_token(t->s),
                          " pid=", getpid()));
    return absl::OkStatus();
  }
  if (name == "register") {
    if (absl::Status st = Register(t, U64(a, "numel", 4096)); !st.ok()) return st;
    Ok(name);
    return absl::OkStatus();
  }
  if (name == "step") {
    const uint64_t n = U64(a, "n", 1);
    dos_step_args args;
    dos_step_args_init(&args);
    args.groups = &t->h;
    args.num_groups = 1;
    dos_step_result r{};
    for (uint64_t i = 0; i < n; ++i) {
      if (absl::Status st = FromDos(dos_step(t->s, &args, &r), "step"); !st.ok()) return st;
    }
    Ok(name, absl::StrCat("step=", r.step));
    return absl::OkStatus();
  }
  if (name == "state_read") {
    std::vector<float> m(t->numel);
    int64_t step = 0;
    if (absl::Status st = FromDos(dos_state_read(t->s, 0, m.data(), nullptr, nullptr, &step),
                                  "state_read");
        !st.ok()) {
      return st;
    }
    Ok(name, absl::StrCat("step=", step));
    return absl::OkStatus();
  }
  if (name == "truncate_own") {
    int total = 0, eperm = 0;
    DIR* d = opendir("/proc/self/fd");
    std::vector<int> fds;
    while (dirent* e = d != nullptr ? readdir(d) : nullptr) {
      int fd;
      if (absl::SimpleAtoi(e->d_name, &fd)) fds.push_back(fd);
    }
    if (d != nullptr) closedir(d);
    for (int fd : fds) {
      char link[256] = {};
      std::string p = absl::StrCat("/proc/self/fd/", fd);
      if (readlink(p.c_str(), link, sizeof link - 1) <= 0) continue;
      if (std::strncmp(link, "/memfd:dos.", 11) != 0) continue;
      ++total;
      if (ftruncate(fd, 0) != 0 && errno == EPERM) ++eperm;
    }
    Ok(name, absl::StrCat("total=", total, " eperm=", eperm));
    return absl::OkStatus();
  }
  if (name == "control") {
    auto cb = dos::fdproto::FetchControlBlock(fd_socket, U64(a, "id", 0), Str(a, "token"));
    if (!cb.ok()) return cb.status();
    Ok(name);
    return absl::OkStatus();
  }
  if (name == "inject" || name == "send_unsealed" || name == "send_file") {
    uint64_t id = U64(a, "id", 0);
    std::string token = Str(a, "token");
    if (name != "inject" && t->s != nullptr) {
      id = dos_session_id(t->s);
      token = dos_session_token(t->s);
    }
    dos::UniqueFd fd;
    if (name == "send_file") {
      char path[] = "/tmp/mem_client.XXXXXX";
      fd.reset(mkstemp(path));
      unlink(path);
      if (ftruncate(fd.get(), 4096) != 0) return absl::InternalError("ftruncate");
    } else {
      fd = Memfd(/*sealed=*/name == "inject");
    }
    const int raw = fd.get();
    auto ids = dos::fdproto::SendSegments(fd_socket, id, token, {&raw, 1});
    if (!ids.ok()) return ids.status();
    Ok(name, absl::StrCat("segment=", (*ids)[0]));
    return absl::OkStatus();
  }
  if (name == "export_truncate") {
    if (t->s == nullptr) return absl::FailedPreconditionError("attach and register first");
    dos::UniqueFd fd(memfd_create("mem_client.x", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (ftruncate(fd.get(), static_cast<off_t>(12 * t->numel)) != 0) {
      return absl::InternalError("ftruncate");
    }
    fcntl(fd.get(), F_ADD_SEALS, dos::ShmSegment::kRequiredSeals);
    const int raw = fd.get();
    auto ids = dos::fdproto::SendSegments(fd_socket, dos_session_id(t->s),
                                          dos_session_token(t->s), {&raw, 1});
    if (!ids.ok()) return ids.status();
    // dosd holds the buffer now: shrinking it under dosd's mapping is what
    // would SIGBUS dosd during the export.
    const bool eperm = ftruncate(fd.get(), 0) != 0 && errno == EPERM;
    auto stub = Stub(t->socket);
    grpc::ClientContext ctx;
    dos::v1::TransferStateRequest req;
    req.mutable_session()->set_session_id(dos_session_id(t->s));
    req.mutable_session()->set_token(dos_session_token(t->s));
    req.set_tensor(0);
    req.mutable_buffer()->set_segment((*ids)[0]);
    req.mutable_buffer()->set_offset(0);
    dos::v1::TransferStateResponse resp;
    if (grpc::Status s = stub->ExportState(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
    Ok(name, absl::StrCat("eperm=", eperm ? 1 : 0, " step=", resp.step()));
    return absl::OkStatus();
  }
  if (name == "register_name" || name == "export_name") {
    if (t->s == nullptr) return absl::FailedPreconditionError("attach first");
    auto stub = Stub(t->socket);
    grpc::ClientContext ctx;
    if (name == "register_name") {
      dos::v1::RegisterShardRequest req;
      req.mutable_session()->set_session_id(dos_session_id(t->s));
      req.mutable_session()->set_token(dos_session_token(t->s));
      auto* ten = req.add_tensors();
      ten->set_name("w");
      ten->set_param_dtype(dos::v1::DTYPE_F32);
      ten->set_grad_dtype(dos::v1::DTYPE_F32);
      ten->set_numel(1024);
      ten->mutable_param()->mutable_shm()->set_name(Str(a, "name"));
      ten->mutable_grad()->mutable_shm()->set_name(Str(a, "name"));
      auto* g = req.add_groups();
      g->set_lr(1e-3);
      g->set_beta1(0.9);
      g->set_beta2(0.999);
      g->set_eps(1e-8);
      dos::v1::RegisterShardResponse resp;
      if (grpc::Status s = stub->RegisterShard(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
    } else {
      dos::v1::TransferStateRequest req;
      req.mutable_session()->set_session_id(dos_session_id(t->s));
      req.mutable_session()->set_token(dos_session_token(t->s));
      req.set_tensor(0);
      req.mutable_buffer()->set_name(Str(a, "name"));
      dos::v1::TransferStateResponse resp;
      if (grpc::Status s = stub->ExportState(&ctx, req, &resp); !s.ok()) return FromGrpc(s);
    }
    Ok(name);
    return absl::OkStatus();
  }
  if (name == "open_devshm") {
    int opened = 0;
    DIR* d = opendir("/dev/shm");
    while (dirent* e = d != nullptr ? readdir(d) : nullptr) {
      if (std::strncmp(e->d_name, "dos", 3) != 0) continue;
      int fd = open(absl::StrCat("/dev/shm/", e->d_name).c_str(), O_RDWR | O_CLOEXEC);
      if (fd >= 0) {
        ++opened;
        close(fd);
      }
    }
    if (d != nullptr) closedir(d);
    Ok(name, absl::StrCat("opened=", opened));
    return absl::OkStatus();
  }
  if (name == "raw_step" || name == "early_stall") {
    auto block = OwnBlock(t);
    if (!block.ok()) return block.status();
    dos::StepRequest& r = (*block)->request;
    if (absl::Status st = WriteRequest(r, Str(a, "field"), Str(a, "value")); !st.ok()) return st;
    if (name == "early_stall") r.flags |= dos::kStepGradientsPending;
    t->raw_seq = dos::ControlBlockChannel(*block).PublishRequest();
    if (name == "early_stall") {
      Ok(name, absl::StrCat("seq=", t->raw_seq));
      return absl::OkStatus();
    }
    return RawWait(t, name, absl::Seconds(60));
  }
  if (name == "raw_wait") {
    return RawWait(t, name, absl::Seconds(static_cast<int64_t>(U64(a, "timeout_s", 60))));
  }
  if (name == "wait") {
    Ok(name);
    char c;
    while (read(0, &c, 1) > 0) {
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown op ", name));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: mem_client SOCKET OP...\n");
    return 2;
  }
  Trainer t;
  t.socket = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string text = argv[i];
    const size_t colon = text.find(':');
    const std::string name = text.substr(0, colon);
    Args args;
    if (colon != std::string::npos) {
      for (absl::string_view kv : absl::StrSplit(text.substr(colon + 1), ',', absl::SkipEmpty())) {
        const size_t eq = kv.find('=');
        args[std::string(kv.substr(0, eq))] =
            eq == absl::string_view::npos ? "" : std::string(kv.substr(eq + 1));
      }
    }
    if (absl::Status st = Run(&t, name, args); !st.ok()) Err(name, st);
  }
  if (t.s != nullptr) dos_detach(t.s);
  return 0;
}
