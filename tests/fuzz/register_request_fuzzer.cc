// libFuzzer target: a dos.v1.RegisterShardRequest from arbitrary bytes, through
// the real gRPC handler (DosService::RegisterShard: request -> ShardSpec ->
// Session::Register -> ShardState) of an in-process daemon with one attached
// session and a 256 MiB host-memory cap. Sizes, counts, dtypes and offsets
// that overflow or exceed the cap must be refused with a status.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "daemon/cpu/cpu_updater.h"
#include "daemon/cpu/host_engine.h"
#include "daemon/rpc/dos_service.h"
#include "daemon/sched/executor_set.h"
#include "daemon/session/session_manager.h"
#include "daemon/state/host_memory_budget.h"
#include "dos/wire/control_block.h"

namespace {

struct Daemon {
  Daemon()
      : budget(uint64_t{256} << 20),
        cpu(Options()),
        host_engine(&cpu),
        executors(&host_engine),
        sessions(SessionOpts(), dos::Policy{}, &executors, &budget),
        service(&sessions, &budget, "fuzz") {}
  static dos::cpu::CpuUpdaterOptions Options() {
    dos::cpu::CpuUpdaterOptions o;
    o.threads = 1;
    return o;
  }
  static dos::SessionOptions SessionOpts() { return dos::SessionOptions{}; }
  // Attaches a fresh session (after one registered successfully).
  void Attach() {
    dos::v1::AttachRequest req;
    req.set_client_name("fuzz");
    req.set_pid(getpid());
    req.set_protocol_version(dos::kProtocolVersion);
    dos::v1::AttachResponse resp;
    if (service.Attach(nullptr, &req, &resp).ok()) ref = resp.session();
  }

  dos::HostMemoryBudget budget;
  dos::cpu::CpuUpdater cpu;
  dos::cpu::HostEngine host_engine;
  dos::ExecutorSet executors;
  dos::SessionManager sessions;
  dos::DosService service;
  dos::v1::SessionRef ref;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Daemon* daemon = [] {
    auto* d = new Daemon();
    d->Attach();
    return d;
  }();
  dos::v1::RegisterShardRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  // Mostly drive the attached session, so validation past the lookup runs;
  // keep the input's own ref when it asks for session 0 to cover the lookup.
  if (req.session().session_id() != 0) *req.mutable_session() = daemon->ref;
  dos::v1::RegisterShardResponse resp;
  grpc::Status s = daemon->service.RegisterShard(nullptr, &req, &resp);
  if (s.ok()) {
    (void)daemon->sessions.Detach(daemon->ref.session_id(), daemon->ref.token());
    daemon->Attach();
  }
  return 0;
}
