// update_trainer: a separate trainer process for the update-phase benchmark
// and the GPU end-to-end checks. It holds a bf16 model's weights and
// gradients in GPU memory (cudaMalloc), exports them to dosd by CUDA IPC,
// and drives steps through the control block, exactly as the client library
// does, so that all optimizer state lives in the daemon.
//
//   update_trainer --socket=S --params=2e9 --subgroup=1e8 \
//       --policies=cpu,static:0.5,interleave:2,auto --steps=5 --out=results.jsonl
//   update_trainer --mode=bad_uuid|bad_range|bad_dtype|die_mid_step ...
//
// Each policy: SetPolicy, `warmup` steps, `steps` timed steps; one JSON line
// per policy with the median update time and the daemon's last-step stats.
#include <cuda_runtime.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/fd_protocol.h"
#include "dos/wire/shm_segment.h"
#include "proto/dos/v1/dos.grpc.pb.h"

namespace {

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

__global__ void Fill(uint16_t* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    float f = (static_cast<float>(h & 0xffffff) / 16777216.0f - 0.5f) * scale;
    p[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);
  }
}

std::string Flag(int argc, char** argv, const char* name, const char* def) {
  std::string key = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], key.c_str(), key.size()) == 0) return argv[i] + key.size();
  }
  return def;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Die(const char* what, const grpc::Status& s) {
  std::fprintf(stderr, "%s: %s\n", what, s.error_message().c_str());
  std::exit(3);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string socket = Flag(argc, argv, "socket", "/tmp/dosd.sock");
  const uint64_t params = static_cast<uint64_t>(std::atof(Flag(argc, argv, "params", "2e9").c_str()));
  const uint64_t subgroup = static_cast<uint64_t>(std::atof(Flag(argc, argv, "subgroup", "1e8").c_str()));
  const uint64_t tensor_numel = static_cast<uint64_t>(std::atof(Flag(argc, argv, "tensor", "5e7").c_str()));
  const std::string mode = Flag(argc, argv, "mode", "bench");
  const int steps = std::atoi(Flag(argc, argv, "steps", "5").c_str());
  const int warmup = std::atoi(Flag(argc, argv, "warmup", "2").c_str());
  const std::string out_path = Flag(argc, argv, "out", "");
  const std::string label = Flag(argc, argv, "label", "");
  // fp32 (12 bytes of state a parameter) or compact (8: bf16 moments).
  const std::string state_format = Flag(argc, argv, "state_format", "fp32");
  if (state_format != "fp32" && state_format != "compact") {
    std::fprintf(stderr, "--state_format=%s: use fp32 or compact\n", state_format.c_str());
    return 2;
  }
  std::vector<std::string> policies = absl::StrSplit(Flag(argc, argv, "policies", "auto"), ',');

  CK(cudaSetDevice(0));
  uint16_t *w = nullptr, *g = nullptr;
  const uint64_t bytes = params * 2;
  CK(cudaMalloc(&w, bytes));
  CK(cudaMalloc(&g, bytes));
  Fill<<<4096, 256>>>(w, params, 1, 0.2f);
  Fill<<<4096, 256>>>(g, params, 2, 0.01f);
  CK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t hw, hg;
  CK(cudaIpcGetMemHandle(&hw, w));
  CK(cudaIpcGetMemHandle(&hg, g));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  // device_uuid travels as text, in nvidia-smi's form.
  const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char uuid_text[64];
  std::snprintf(uuid_text, sizeof uuid_text,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  std::string uuid = uuid_text;
  if (mode == "bad_uuid") uuid[4] = uuid[4] == 'f' ? '0' : 'f';

  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  auto stub = dos::v1::Dos::NewStub(channel);
  dos::v1::AttachRequest areq;
  areq.set_client_name("update_trainer");
  areq.set_pid(getpid());
  areq.set_rank(-1);
  areq.set_world_size(1);
  areq.set_protocol_version(dos::kProtocolVersion);
  const std::string fd_socket = dos::fdproto::SocketPathFor(socket);
  {
    auto ticket = dos::fdproto::Hello(fd_socket);
    if (!ticket.ok()) {
      std::fprintf(stderr, "hello: %s\n", std::string(ticket.status().message()).c_str());
      return 4;
    }
    areq.set_fd_ticket(*ticket);
  }
  dos::v1::AttachResponse aresp;
  {
    grpc::ClientContext ctx;
    grpc::Status s = stub->Attach(&ctx, areq, &aresp);
    if (!s.ok()) Die("attach", s);
  }
  dos::v1::RegisterShardRequest rreq;
  *rreq.mutable_session() = aresp.session();
  rreq.set_subgroup_size(subgroup);
  rreq.set_state_format(state_format == "compact" ? dos::v1::STATE_FORMAT_COMPACT
                                                  : dos::v1::STATE_FORMAT_FP32);
  auto* h = rreq.add_groups();
  h->set_lr(1e-3); h->set_beta1(0.9); h->set_beta2(0.999); h->set_eps(1e-8);
  h->set_weight_decay(0.01); h->set_decoupled_weight_decay(true);
  int ntensors = 0;
  for (uint64_t off = 0; off < params; off += tensor_numel, ++ntensors) {
    const uint64_t n = std::min(tensor_numel, params - off);
    auto* t = rreq.add_tensors();
    t->set_name("layer" + std::to_string(ntensors));
    t->set_param_dtype(dos::v1::DTYPE_BF16);
    t->set_grad_dtype(mode == "bad_dtype" ? static_cast<dos::v1::DType>(9) : dos::v1::DTYPE_BF16);
    t->set_numel(n);
    for (auto [loc, handle] : {std::pair{t->mutable_param(), &hw}, std::pair{t->mutable_grad(), &hg}}) {
      auto* c = loc->mutable_cuda_ipc();
      c->set_handle(std::string(reinterpret_cast<const char*>(handle), sizeof(cudaIpcMemHandle_t)));
      c->set_offset(off * 2);
      c->set_alloc_bytes(mode == "bad_range" ? bytes / 2 : bytes);
      c->set_device_uuid(uuid);
    }
  }
  dos::v1::RegisterShardResponse rresp;
  {
    grpc::ClientContext ctx;
    const double t0 = Now();
    grpc::Status s = stub->RegisterShard(&ctx, rreq, &rresp);
    if (mode == "bad_uuid" || mode == "bad_range" || mode == "bad_dtype") {
      std::printf("{\"mode\":\"%s\",\"rejected\":%s,\"code\":%d,\"message\":\"%s\"}\n",
                  mode.c_str(), s.ok() ? "false" : "true", static_cast<int>(s.error_code()),
                  s.error_message().c_str());
      return s.ok() ? 1 : 0;
    }
    if (!s.ok()) Die("register", s);
    std::fprintf(stderr, "registered %llu params, %u subgroups in %.2f s\n",
                 static_cast<unsigned long long>(rresp.total_params()), rresp.num_subgroups(),
                 Now() - t0);
  }
  auto handle = dos::fdproto::FetchControlBlock(fd_socket, aresp.session().session_id(),
                                                aresp.session().token());
  if (!handle.ok()) { std::fprintf(stderr, "control block: %s\n", std::string(handle.status().message()).c_str()); return 4; }
  auto segment = dos::ShmSegment::Adopt(std::move(handle->memfd), "control block");
  if (!segment.ok()) { std::fprintf(stderr, "control block: %s\n", std::string(segment.status().message()).c_str()); return 4; }
  auto* block = static_cast<dos::ControlBlock*>((*segment)->data());
  dos::ControlBlockChannel chan(block);
  chan.SetDaemonConnection(handle->connection.get());

  auto step = [&](double* update_us) {
    dos::StepRequest& r = block->request;
    r.flags = dos::kStepGradientsChecked;
    r.num_groups = 1;
    r.grad_scale = 1;
    r.clip_coef = 1;
    r.groups[0] = dos::GroupStepParams{1e-3, 0.9, 0.999, 1e-8, 0.01};
    // The gradients are final on the device (backward done): the daemon's
    // streams may read them once the doorbell rings.
    CK(cudaDeviceSynchronize());
    uint32_t seq = chan.PublishRequest();
    if (mode == "die_mid_step") _exit(0);  // killed with the step in flight
    absl::Status st = chan.WaitResult(seq, absl::Seconds(120));
    if (!st.ok() || block->result.status_code != 0) {
      std::fprintf(stderr, "step failed: %s %s\n", std::string(st.message()).c_str(), block->result.message);
      std::exit(5);
    }
    *update_us = block->result.update_us;
  };

  FILE* out = out_path.empty() ? nullptr : std::fopen(out_path.c_str(), "a");
  for (const std::string& policy : policies) {
    {
      dos::v1::SetPolicyRequest preq;
      *preq.mutable_session() = aresp.session();
      preq.set_policy(policy);
      dos::v1::SetPolicyResponse presp;
      grpc::ClientContext ctx;
      grpc::Status s = stub->SetPolicy(&ctx, preq, &presp);
      if (!s.ok()) Die("set_policy", s);
    }
    std::vector<double> times;
    double us = 0;
    for (int i = 0; i < warmup; ++i) step(&us);
    for (int i = 0; i < steps; ++i) { step(&us); times.push_back(us); }
    std::sort(times.begin(), times.end());
    const double med = times[times.size() / 2];
    dos::v1::GetStatsRequest sreq;
    sreq.set_session_id(aresp.session().session_id());
    dos::v1::GetStatsResponse sresp;
    grpc::ClientContext ctx;
    grpc::Status s = stub->GetStats(&ctx, sreq, &sresp);
    if (!s.ok()) Die("stats", s);
    const dos::v1::StepStats& st = sresp.sessions(0).last_step();
    size_t free_b = 0, total_b = 0;
    CK(cudaMemGetInfo(&free_b, &total_b));
    char line[2048];
    std::snprintf(line, sizeof line,
        "{\"policy\":\"%s\",\"label\":\"%s\",\"params\":%llu,\"gparams\":%.4f,\"update_ms\":%.2f,"
        "\"best_ms\":%.2f,\"predicted_ms\":%.2f,\"h2d_gbps\":%.2f,\"d2h_gbps\":%.2f,\"cpu_busy\":%.3f,"
        "\"gpu_busy\":%.3f,\"h2d_busy\":%.3f,\"d2h_busy\":%.3f,\"cpu_subgroups\":%llu,"
        "\"gpu_subgroups\":%llu,\"resident_subgroups\":%llu,\"model_x\":%.3f,\"binding\":\"%s\","
        "\"daemon_gpu_bytes\":%llu,\"device_used_bytes\":%llu}",
        policy.c_str(), label.c_str(), static_cast<unsigned long long>(params),
        params / (med * 1e-6) * 1e-9, med * 1e-3, times[0] * 1e-3, st.predicted_us() * 1e-3,
        st.h2d_gbps(), st.d2h_gbps(), st.cpu_busy(), st.gpu_busy(), st.h2d_busy(), st.d2h_busy(),
        static_cast<unsigned long long>(st.cpu_subgroups()),
        static_cast<unsigned long long>(st.gpu_subgroups()),
        static_cast<unsigned long long>(st.resident_subgroups()), st.model_gpu_share(),
        st.model_binding().c_str(), static_cast<unsigned long long>(st.gpu_memory_bytes()),
        static_cast<unsigned long long>(total_b - free_b));
    std::printf("%s\n", line);
    std::fflush(stdout);
    if (out) { std::fprintf(out, "%s\n", line); std::fflush(out); }
  }
  // Checksum of the weights, for comparing runs.
  std::vector<uint16_t> host(std::min<uint64_t>(params, 1 << 20));
  CK(cudaMemcpy(host.data(), w, host.size() * 2, cudaMemcpyDeviceToHost));
  uint64_t sum = 0;
  for (uint16_t v : host) sum = sum * 31 + v;
  std::fprintf(stderr, "weights checksum %llx\n", static_cast<unsigned long long>(sum));
  if (out) std::fclose(out);
  dos::v1::DetachRequest dreq;
  *dreq.mutable_session() = aresp.session();
  dos::v1::DetachResponse dresp;
  grpc::ClientContext ctx;
  stub->Detach(&ctx, dreq, &dresp);
  return 0;
}
