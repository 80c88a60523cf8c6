// Session::Register, one step per function: validate the spec, pick the
// executor (engine and planner) of the tensors' memory, map the tensors, get
// the state (the resumed session's, or a new one initialised from the
// trainer's weights or a checkpoint), bind it to the engine (page-lock,
// trainer event), publish. Nothing is kept if any step fails.
#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "daemon/state/host_guard.h"
#include "daemon/checkpoint/checkpoint_reader.h"
#include "daemon/checkpoint/shard_checkpoint.h"
#include "daemon/common/log.h"
#include "dos/wire/status_macros.h"
#include "daemon/session/session.h"

namespace dos {

// What Register builds before it commits it to the session.
struct Session::Registration {
  StepExecutor* executor = nullptr;
  GpuDeviceInfo device;  // ordinal -1: the host engine
  std::unique_ptr<Transport> transport;
  std::vector<TensorBinding> bindings;
  std::vector<TensorDesc> infos;  // the spec's descriptions
  std::unique_ptr<ShardState> shard;
  std::string restored_from;  // "", "resume" or a checkpoint path
  void* trainer_event = nullptr;
  bool attached = false;  // the engine's AttachShard ran (new state: before its weights)
  // The tensors' bookkeeping (ChargeBookkeeping), the session's once published.
  LedgerCharge tensors_charge;
  LedgerCharge bookkeeping_charge;
};

namespace {

absl::Status AlreadyRegistered(uint64_t session) {
  return absl::FailedPreconditionError(
      absl::StrCat("register: session ", session,
                   " already has a registered shard; attach a new session to register "
                   "different tensors"));
}

}  // namespace

absl::Status Session::BeginRegister() {
  if (registered()) return AlreadyRegistered(identity_.id);
  bool idle = false;
  if (!registering_.compare_exchange_strong(idle, true)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "register: session ", identity_.id,
        " is being registered by another RegisterShard call; register once per session and "
        "wait for the answer"));
  }
  return absl::OkStatus();
}

absl::Status Session::Register(const ShardSpec& given) {
  OthersLock lock(this);
  absl::Cleanup progress_done = [this] { register_progress_->Finish(); };
  ShardSpec spec = given;  // its segments resolved below
  if (shard_ != nullptr) return AlreadyRegistered(identity_.id);
  DOS_RETURN_IF_ERROR(ValidateShardSpec(spec));
  Registration reg;
  DOS_RETURN_IF_ERROR(ChargeBookkeeping(spec, &reg));
  DOS_RETURN_IF_ERROR(PickExecutor(spec, &reg));
  // The segments the spec names by id, out of the inbox (a failed Register
  // frees them: the client sends them again).
  DOS_RETURN_IF_ERROR(ResolveSegments(&spec));
  DOS_RETURN_IF_ERROR(MapTensors(spec, &reg));
  DOS_RETURN_IF_ERROR(adopted_ != nullptr ? ResumeState(spec, &reg) : NewState(spec, &reg));
  absl::Status bound = BindEngine(spec, &reg);
  if (!bound.ok()) {
    // A resumed state goes back to wait for the next attempt.
    if (reg.restored_from == "resume") adopted_ = std::move(reg.shard);
    return bound;
  }
  Publish(&reg);
  holds_adopted_.store(false, std::memory_order_release);
  return StartStepThread();
}

absl::Status Session::CheckBookkeeping(uint64_t tensors, uint64_t bookkeeping_bytes) const {
  DOS_ASSIGN_OR_RETURN(LedgerCharge t, account_->Charge(UidResource::kTensors, tensors, "register"));
  DOS_ASSIGN_OR_RETURN(LedgerCharge b, account_->Charge(UidResource::kBookkeepingBytes,
                                                        bookkeeping_bytes, "register"));
  return absl::OkStatus();
}

absl::Status Session::ChargeBookkeeping(const ShardSpec& spec, Registration* reg) {
  const uint64_t n = spec.tensors.size();
  uint64_t bytes = 0;
  for (const TensorSpec& t : spec.tensors) {
    bytes += kBookkeepingBytesPerTensor + t.desc.name.size();
  }
  DOS_ASSIGN_OR_RETURN(reg->tensors_charge,
                       account_->Charge(UidResource::kTensors, n, "register"));
  DOS_ASSIGN_OR_RETURN(reg->bookkeeping_charge,
                       account_->Charge(UidResource::kBookkeepingBytes, bytes, "register"));
  return absl::OkStatus();
}

absl::Status Session::PickExecutor(const ShardSpec& spec, Registration* reg) {
  if (!InDeviceMemory(spec)) {
    reg->executor = executors_->host();
  } else {
    // The engine of the device the tensors live on (the rank's GPU), by UUID.
    const TensorSpec& t0 = spec.tensors[0];
    DOS_ASSIGN_OR_RETURN(
        ExecutorSet::Device d,
        executors_->ForDeviceUuid(t0.param.device_uuid, TensorWhat(0, t0.desc.name, "param")));
    reg->executor = d.executor;
    reg->device = d.device;
  }
  reg->transport = reg->executor->engine()->NewTransport();
  return absl::OkStatus();
}

absl::Status Session::MapTensors(const ShardSpec& spec, Registration* reg) {
  for (uint32_t i = 0; i < spec.tensors.size(); ++i) {
    const TensorSpec& t = spec.tensors[i];
    const TensorDesc& d = t.desc;
    TensorBinding b;
    DOS_ASSIGN_OR_RETURN(b.param, reg->transport->Map(t.param, d.numel * DTypeSize(d.param_dtype),
                                                      TensorWhat(i, d.name, "param")));
    DOS_ASSIGN_OR_RETURN(void* grad, reg->transport->Map(t.grad, d.numel * DTypeSize(d.grad_dtype),
                                                         TensorWhat(i, d.name, "grad")));
    b.grad = grad;
    reg->bindings.push_back(b);
    reg->infos.push_back(d);
  }
  return absl::OkStatus();
}

absl::Status Session::ResumeState(const ShardSpec& spec, Registration* reg) {
  // A resumed session: the state survived the trainer's death. The new
  // process must register the same layout; its weights are rewritten from
  // the fp32 masters, so it continues exactly where the state stands.
  CheckpointLayout wanted;
  wanted.tensors = reg->infos;
  wanted.groups = spec.groups;
  DOS_RETURN_IF_ERROR(CheckLayoutMatches(
      wanted, *adopted_,
      LayoutSides{.subject = absl::StrCat("register: the tensors do not match the state session ",
                                          identity_.id, " kept for its trainer"),
                  .first = "in this registration",
                  .second = "in the kept state",
                  .fix = "resume with the model, parameters and param groups of that run "
                         "(the state waits for another try within the lease)"}));
  if (adopted_->format() != spec.state_format) {
    return absl::FailedPreconditionError(absl::StrCat(
        "register: session ", identity_.id, " resumes state kept in ",
        StateFormatName(adopted_->format()), " format but asks for ",
        StateFormatName(spec.state_format), "; register with the format the run started with "
        "(to change it, save a checkpoint and load it into a new session)"));
  }
  reg->shard = std::move(adopted_);
  reg->restored_from = "resume";
  return absl::OkStatus();
}

absl::Status Session::NewState(const ShardSpec& spec, Registration* reg) {
  uint64_t numel = 0;
  for (const TensorDesc& t : reg->infos) numel += t.numel;
  uint64_t subgroup_size =
      spec.subgroup_size != 0 ? spec.subgroup_size : options_.default_subgroup_size;
  if (subgroup_size < kMinSubgroupSize) {
    // One page-aligned allocation per subgroup: tiny subgroups would cost a
    // page (and bookkeeping) per handful of parameters.
    DOS_LOG_INFO("session.subgroup_size_raised", "session", identity_.id, "requested",
                 subgroup_size, "used", kMinSubgroupSize);
    subgroup_size = kMinSubgroupSize;
  }
  if (subgroup_size >= ShardState::kMapAlignMinSubgroup &&
      subgroup_size % ShardState::kMapAlignElems != 0) {
    // A multiple of the map alignment, so the owner's state_dict() maps its
    // state instead of copying it (shard_state.h).
    subgroup_size += ShardState::kMapAlignElems - subgroup_size % ShardState::kMapAlignElems;
  }
  // What registering really allocates (page-aligned subgroups), not 12 (or
  // 8) bytes per parameter.
  const uint64_t bytes = ShardState::AllocatedBytes(numel, subgroup_size, spec.state_format);
  if (options_.memory_limit != 0 && bytes > options_.memory_limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: the tensors hold ", numel, " parameters in subgroups of ", subgroup_size,
        ", ", FormatBytes(bytes), " of optimizer state with its page-aligned subgroups; "
        "dosd's --session_memory_limit allows ", FormatBytes(options_.memory_limit),
        " per session; shard the model over more ranks, use larger subgroups",
        spec.state_format == StateFormat::kFp32 ? ", use compact state (8 bytes a parameter)" : "",
        " or raise the limit"));
  }
  // Beside what the host has committed already: a registration that cannot
  // be held is refused here, not answered by the kernel's OOM killer.
  DOS_RETURN_IF_ERROR(
      CheckHostCanHold(bytes, absl::StrCat("session ", identity_.id, " (", numel,
                                           " parameters)")));
  // Charged to the uid, not the session: the state outlives the session
  // while a resume may adopt it or its views are still mapped. Only to a
  // ledger that outlives the session (as the state views' charge).
  LedgerCharge state_charge;
  if (own_ledger_ == nullptr && account_ != nullptr) {
    const std::string what = absl::StrCat("register: session ", identity_.id);
    absl::StatusOr<LedgerCharge> charge =
        account_->ledger()->Charge(identity_.uid, UidResource::kStateBytes, bytes, what);
    if (!charge.ok() && budget_ != nullptr) {
      budget_->ReapViews();  // closed sessions' views dropped since the last reap count no more
      charge = account_->ledger()->Charge(identity_.uid, UidResource::kStateBytes, bytes, what);
    }
    if (!charge.ok()) return charge.status();
    state_charge = std::move(*charge);
  }
  DOS_ASSIGN_OR_RETURN(reg->shard,
                       ShardState::Create(std::move(reg->infos), spec.groups, subgroup_size,
                                          budget_,
                                          absl::StrCat("register: session ", identity_.id),
                                          {.format = spec.state_format,
                                           .huge_pages = options_.huge_pages,
                                           .progress = register_progress_.get()}));
  reg->shard->set_state_charge(std::move(state_charge));
  // Page-locked (GPU engines) before the weights come over: they then land
  // at PCIe speed (StepExecutor::ReadWeights stages them in exp_avg).
  DOS_RETURN_IF_ERROR(reg->executor->engine()->AttachShard(*reg->shard, register_progress_.get()));
  reg->attached = true;
  // Initialise the fp32 masters from the trainer's weights.
  register_progress_->BeginPhase(kRegisterReadingWeights, numel * sizeof(float));
  for (uint32_t i = 0; i < reg->shard->tensors().size(); ++i) {
    DOS_RETURN_IF_ERROR(reg->executor->ReadWeights(*reg->shard, reg->bindings, i));
    register_progress_->Add(reg->shard->tensors()[i].numel * sizeof(float));
  }
  // A daemon restarted with checkpoints of this client name and rank: the
  // first (the newest) whose layout matches is loaded. LoadShard leaves
  // the state untouched on any failure, so a bad file only costs a log line.
  for (const std::string& path : restore_candidates_) {
    absl::Status st = LoadShard(reg->shard.get(), path, restore_env_);
    if (st.ok()) {
      reg->restored_from = path;
      break;
    }
    DOS_LOG_WARNING("session.restore_skipped", "session", identity_.id, "path", path, "error",
                    st.message());
  }
  restore_candidates_.clear();
  return absl::OkStatus();
}

absl::Status Session::BindEngine(const ShardSpec& spec, Registration* reg) {
  if (!reg->restored_from.empty()) {
    for (uint32_t i = 0; i < reg->shard->tensors().size(); ++i) {
      DOS_RETURN_IF_ERROR(reg->executor->WriteWeights(*reg->shard, reg->bindings, i));
    }
    DOS_LOG_INFO("session.restored", "session", identity_.id, "from", reg->restored_from, "step",
                 LatestStep(reg->shard->tensors()));
  }
  Engine* engine = reg->executor->engine();
  if (!reg->attached) {  // a resumed shard (new ones are attached in NewState)
    DOS_RETURN_IF_ERROR(engine->AttachShard(*reg->shard, register_progress_.get()));
  }
  if (!spec.cuda_ipc_event.empty()) {
    DOS_ASSIGN_OR_RETURN(reg->trainer_event, engine->OpenTrainerEvent(spec.cuda_ipc_event));
  }
  return absl::OkStatus();
}

void Session::Publish(Registration* reg) {
  const ShardState& shard = *reg->shard;
  std::vector<std::pair<uint32_t, uint32_t>> tensor_subgroups(shard.tensors().size(),
                                                              {UINT32_MAX, 0});
  for (uint32_t k = 0; k < shard.subgroups().size(); ++k) {
    for (const SubgroupSegment& seg : shard.subgroups()[k].segments) {
      auto& r = tensor_subgroups[seg.tensor];
      r.first = std::min(r.first, k);
      r.second = std::max(r.second, k);
    }
  }
  {
    absl::MutexLock stats_lock(&stats_mu_);
    summary_ = Summary{.registered = true,
                       .params = shard.total_params(),
                       .tensors = static_cast<uint32_t>(shard.tensors().size()),
                       .subgroups = static_cast<uint32_t>(shard.subgroups().size()),
                       .state_bytes = shard.state_bytes(),
                       .state_format = shard.format(),
                       .step = LatestStep(shard.tensors()),
                       .restored_from = reg->restored_from,
                       .tensor_subgroups = std::move(tensor_subgroups),
                       .gpu_device = reg->device.ordinal,
                       .gpu_uuid = reg->device.uuid};
  }
  DOS_LOG_INFO("session.register", "session", identity_.id, "uid", identity_.uid, "tensors",
               shard.tensors().size(), "params", shard.total_params(), "subgroups", shard.subgroups().size(),
               "state_bytes", shard.state_bytes(), "state_format",
               StateFormatName(shard.format()), "device", reg->executor->engine()->name(),
               "gpu_uuid", reg->device.uuid);
  if (executor_ != reg->executor) executor_->ForgetSession(identity_.id);
  executor_ = reg->executor;
  executor_->BindSession(identity_.id);
  tensors_charge_ = std::move(reg->tensors_charge);
  bookkeeping_charge_ = std::move(reg->bookkeeping_charge);
  transport_ = std::move(reg->transport);
  bindings_ = std::move(reg->bindings);
  trainer_event_ = reg->trainer_event;
  shard_ = std::move(reg->shard);
  delayed_.reset();  // a new shard: nothing of the old one's delayed path applies
}

}  // namespace dos
