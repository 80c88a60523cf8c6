// Writes seed corpora for the fuzzers into DIR/<fuzzer>/: valid checkpoints
// (several layouts and chunk sizes), a valid control block image, and
// RegisterShardRequests a client would send. Run by tests/run_fuzz.sh.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "daemon/checkpoint/checkpoint_writer.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/fd_protocol.h"
#include "proto/dos/v1/dos.pb.h"
#include "tests/unit/checkpoint/fake_env.h"

namespace {

void WriteFile(const std::string& path, const std::string& data) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return;
  std::fwrite(data.data(), 1, data.size(), f);
  std::fclose(f);
}

void CheckpointSeeds(const std::string& dir) {
  int n = 0;
  // fp32 state (file version 1) and compact state (version 2, bf16 moments).
  for (dos::StateFormat format : {dos::StateFormat::kFp32, dos::StateFormat::kCompact}) {
  for (uint32_t chunk : {4u, 16u, 1024u}) {
    for (int tensors = 1; tensors <= 3; ++tensors) {
      dos::CheckpointLayout l;
      l.state_format = format;
      l.subgroup_size = 5;
      l.owner = "seed";
      l.groups.resize(2);
      l.groups[1].decoupled_weight_decay = false;
      for (int t = 0; t < tensors; ++t) {
        l.tensors.push_back({.name = "t" + std::to_string(t),
                             .param_dtype = dos::DType::kBF16,
                             .numel = static_cast<uint64_t>(1 + 3 * t),
                             .group = static_cast<uint32_t>(t % 2),
                             .step = t});
      }
      dos::testing::MemEnv env;
      dos::CheckpointWriterOptions o;
      o.chunk_bytes = chunk;
      o.created_unix_seconds = 1;
      auto w = dos::CheckpointWriter::Create("/c", l, &env, o);
      if (!w.ok()) continue;
      for (uint32_t t = 0; t < l.tensors.size(); ++t) {
        for (uint32_t a = 0; a < 3; ++a) {
          std::vector<float> v(l.tensors[t].numel, 0.5f * (t + a));
          std::vector<uint16_t> h(v.size(), dos::FloatToBF16(0.5f * (t + a)));
          const auto which = static_cast<dos::StateArray>(a);
          (void)(*w)->BeginSection(t, which);
          if (dos::ElementBytes(l, which) == 2) {
            (void)(*w)->AppendBf16(h.data(), h.size());
          } else {
            (void)(*w)->Append(v.data(), v.size());
          }
          (void)(*w)->EndSection();
        }
      }
      if ((*w)->Commit().ok()) WriteFile(dir + "/seed" + std::to_string(n++), *env.Get("/c"));
    }
  }
  }
}

void ControlBlockSeeds(const std::string& dir) {
  dos::ControlBlock block;
  std::memset(static_cast<void*>(&block), 0, sizeof block);
  dos::ControlBlockChannel::InitBlock(&block, 7, getpid());
  block.request.num_groups = 2;
  block.request.grad_scale = 1;
  block.request.clip_coef = 1;
  for (int g = 0; g < 2; ++g) block.request.groups[g] = {1e-3, 0.9, 0.999, 1e-8, 0.01};
  std::string image(1, '\x01');  // registered groups = 1 + 1 % 64 = 2
  image.append(reinterpret_cast<const char*>(&block), sizeof block);
  WriteFile(dir + "/valid", image);
  WriteFile(dir + "/short", image.substr(0, 100));
}

void RegisterSeeds(const std::string& dir) {
  dos::v1::RegisterShardRequest req;
  req.mutable_session()->set_session_id(1);
  req.mutable_session()->set_token("x");
  req.set_subgroup_size(1000);
  auto* g = req.add_groups();
  g->set_lr(1e-3);
  g->set_beta1(0.9);
  g->set_beta2(0.999);
  g->set_eps(1e-8);
  g->set_decoupled_weight_decay(true);
  for (int t = 0; t < 2; ++t) {
    auto* ts = req.add_tensors();
    ts->set_name("w" + std::to_string(t));
    ts->set_param_dtype(dos::v1::DTYPE_BF16);
    ts->set_grad_dtype(dos::v1::DTYPE_BF16);
    ts->set_numel(1000 + t);
    ts->mutable_param()->mutable_shm()->set_segment(1);
    ts->mutable_grad()->mutable_shm()->set_segment(2);
    ts->mutable_grad()->mutable_shm()->set_offset(4096 * t);
  }
  WriteFile(dir + "/two_tensors", req.SerializeAsString());
  req.mutable_tensors(1)->set_numel(~uint64_t{0});
  WriteFile(dir + "/huge_numel", req.SerializeAsString());
}

// Each op, with 0-2 descriptors of the kinds fd_handshake_fuzzer makes.
void FdHandshakeSeeds(const std::string& dir) {
  using dos::fdproto::Op;
  int n = 0;
  for (auto [op, fds] : {std::pair{Op::kHello, 0}, std::pair{Op::kControlBlock, 0},
                         std::pair{Op::kSegments, 1}, std::pair{Op::kSegments, 2}}) {
    dos::fdproto::Request r = dos::fdproto::MakeRequest(op, 7, "secret", fds);
    std::string bytes = {static_cast<char>(fds), 0, 1, 0, 0};
    bytes.append(reinterpret_cast<const char*>(&r), sizeof r);
    std::ofstream(dir + "/seed" + std::to_string(n++), std::ios::binary) << bytes;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds DIR\n");
    return 2;
  }
  const std::string root = argv[1];
  for (const char* d : {"checkpoint_reader_fuzzer", "control_block_fuzzer",
                        "register_request_fuzzer", "fd_handshake_fuzzer"}) {
    std::filesystem::create_directories(root + "/" + d);
  }
  CheckpointSeeds(root + "/checkpoint_reader_fuzzer");
  ControlBlockSeeds(root + "/control_block_fuzzer");
  RegisterSeeds(root + "/register_request_fuzzer");
  FdHandshakeSeeds(root + "/fd_handshake_fuzzer");
  return 0;
}
