// The C ABI (client/include/dos/dos.h) over dos::client::ClientSession.
//
// This file is the client library's one adapter: it converts absl::Status to
// dos_status and the thread's last-error message (ToDosStatus, the only
// place), and it catches anything a library below might throw, so no
// exception crosses the C boundary.
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "dos/dos.h"
#include "daemon_probe.h"
#include "dos/version.h"
#include "device_memory.h"
#include "session.h"

struct dos_session {
  std::unique_ptr<dos::client::ClientSession> impl;
};

namespace {

thread_local std::string g_last_error;

dos_status ToDosStatus(const absl::Status& status) {
  if (status.ok()) {
    g_last_error.clear();
    return DOS_OK;
  }
  g_last_error = std::string(status.message());
  const int code = static_cast<int>(status.code());
  return (code > 0 && code <= DOS_UNAUTHENTICATED) ? static_cast<dos_status>(code) : DOS_UNKNOWN;
}

// Runs `fn` (returning absl::Status) and converts the outcome; exceptions from
// gRPC / protobuf / the allocator become INTERNAL.
template <typename Fn>
dos_status Guard(const char* call, Fn&& fn) {
  try {
    return ToDosStatus(fn());
  } catch (const std::exception& e) {
    return ToDosStatus(absl::InternalError(absl::StrCat(call, ": ", e.what())));
  } catch (...) {
    return ToDosStatus(absl::InternalError(absl::StrCat(call, ": unknown exception")));
  }
}

absl::Status NeedSession(const dos_session* s, const char* call) {
  if (s == nullptr || s->impl == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": session is NULL"));
  }
  return absl::OkStatus();
}

absl::Duration TimeoutFromMs(int64_t ms) {
  return ms < 0 ? absl::InfiniteDuration() : absl::Milliseconds(ms);
}

}  // namespace

extern "C" {

const char* dos_last_error(void) { return g_last_error.c_str(); }

const char* dos_version(void) { return DOS_VERSION_STRING; }

int32_t dos_cuda_supported(void) { return dos::client::DeviceMemory::Compiled() ? 1 : 0; }

const char* dos_default_socket(void) {
  const char* env = std::getenv("DOS_SOCKET");
  return (env != nullptr && env[0] != '\0') ? env : "/run/dos/dosd.sock";
}

dos_status dos_daemon_probe(const char* socket_path, int64_t timeout_ms, dos_daemon_info* out) {
  thread_local dos::client::DaemonInfo info;
  return Guard("daemon_probe", [&]() -> absl::Status {
    if (out == nullptr) return absl::InvalidArgumentError("daemon_probe: out is NULL");
    const std::string socket = socket_path != nullptr ? socket_path : dos_default_socket();
    absl::StatusOr<dos::client::DaemonInfo> got =
        dos::client::ProbeDaemon(socket, timeout_ms > 0 ? timeout_ms : 5000);
    out->client_protocol_version = dos::client::ClientProtocolVersion();
    out->client_version = dos::client::ClientRelease();
    if (!got.ok()) return got.status();
    info = *std::move(got);
    out->pid = info.pid;
    out->version = info.version.c_str();
    out->protocol_version = info.protocol_version;
    out->health = info.health.c_str();
    out->sessions = info.sessions;
    return absl::OkStatus();
  });
}

void dos_attach_options_init(dos_attach_options* options) {
  if (options == nullptr) return;
  options->socket_path = nullptr;
  options->client_name = nullptr;
  options->rank = -1;
  options->local_rank = 0;
  options->world_size = 1;
  options->timeout_ms = 0;
}

namespace {
dos_status AttachOrResume(const char* call, const dos_attach_options* options,
                          uint64_t resume_id, const char* resume_token, dos_session** out) {
  return Guard(call, [&]() -> absl::Status {
    if (out == nullptr) return absl::InvalidArgumentError(absl::StrCat(call, ": out is NULL"));
    *out = nullptr;
    dos_attach_options defaults;
    dos_attach_options_init(&defaults);
    const dos_attach_options& o = options != nullptr ? *options : defaults;
    dos::client::ClientSession::Options opts;
    opts.socket_path = o.socket_path != nullptr ? o.socket_path : dos_default_socket();
    opts.client_name = o.client_name != nullptr ? o.client_name : "dos-client";
    opts.rank = o.rank;
    opts.local_rank = o.local_rank;
    opts.world_size = o.world_size;
    opts.rpc_timeout = o.timeout_ms > 0 ? absl::Milliseconds(o.timeout_ms) : absl::Seconds(30);
    opts.resume_session_id = resume_id;
    opts.resume_token = resume_token != nullptr ? resume_token : "";
    auto session = dos::client::ClientSession::Attach(opts);
    if (!session.ok()) return session.status();
    *out = new dos_session{std::move(session).value()};
    return absl::OkStatus();
  });
}
}  // namespace

dos_status dos_attach(const dos_attach_options* options, dos_session** out) {
  return AttachOrResume("attach", options, 0, nullptr, out);
}

dos_status dos_resume(const dos_attach_options* options, uint64_t session_id, const char* token,
                      dos_session** out) {
  if (session_id == 0 || token == nullptr || token[0] == '\0') {
    return Guard("resume", [&]() -> absl::Status {
      return absl::InvalidArgumentError(
          "resume: session_id must be non-zero and token non-empty; pass what "
          "dos_session_id() and dos_session_token() returned in the process that died");
    });
  }
  return AttachOrResume("resume", options, session_id, token, out);
}

const char* dos_session_token(const dos_session* session) {
  return (session != nullptr && session->impl != nullptr) ? session->impl->token().c_str() : "";
}

int32_t dos_session_resumed(const dos_session* session) {
  return (session != nullptr && session->impl != nullptr && session->impl->resumed()) ? 1 : 0;
}

dos_status dos_detach(dos_session* session) {
  if (session == nullptr) return ToDosStatus(absl::OkStatus());
  dos_status st = Guard("detach", [&]() -> absl::Status {
    return session->impl != nullptr ? session->impl->Detach() : absl::OkStatus();
  });
  std::string err = g_last_error;
  Guard("detach", [&]() -> absl::Status {
    delete session;
    return absl::OkStatus();
  });
  g_last_error = std::move(err);
  return st;
}

uint64_t dos_session_id(const dos_session* session) {
  return (session != nullptr && session->impl != nullptr) ? session->impl->id() : 0;
}

dos_status dos_buffer_alloc(dos_session* session, uint64_t bytes, void** out) {
  return Guard("buffer_alloc", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "buffer_alloc"); !st.ok()) return st;
    if (out == nullptr) return absl::InvalidArgumentError("buffer_alloc: out is NULL");
    auto p = session->impl->AllocBuffer(bytes);
    if (!p.ok()) return p.status();
    *out = *p;
    return absl::OkStatus();
  });
}

void dos_hparams_init_adamw(dos_hparams* h) {
  if (h == nullptr) return;
  h->lr = 1e-3;
  h->beta1 = 0.9;
  h->beta2 = 0.999;
  h->eps = 1e-8;
  h->weight_decay = 1e-2;
  h->decoupled_weight_decay = 1;
}

dos_status dos_set_state_format(dos_session* session, dos_state_format format) {
  return Guard("set_state_format", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "set_state_format"); !st.ok()) return st;
    return session->impl->SetStateFormat(static_cast<int>(format));
  });
}

dos_status dos_register(dos_session* session, const dos_tensor* tensors, size_t num_tensors,
                        const dos_hparams* groups, size_t num_groups,
                        const dos_register_options* options) {
  return Guard("register", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "register"); !st.ok()) return st;
    if ((tensors == nullptr && num_tensors != 0) || (groups == nullptr && num_groups != 0)) {
      return absl::InvalidArgumentError("register: tensors or groups is NULL");
    }
    return session->impl->Register(absl::MakeConstSpan(tensors, num_tensors),
                                   absl::MakeConstSpan(groups, num_groups),
                                   options != nullptr ? options->subgroup_size : 0);
  });
}

dos_status dos_register_progress_read(const dos_session* session, dos_register_progress* out) {
  return Guard("register_progress", [&]() -> absl::Status {
    if (session == nullptr || session->impl == nullptr) {
      return absl::InvalidArgumentError("register_progress: session is NULL");
    }
    if (out == nullptr) return absl::InvalidArgumentError("register_progress: out is NULL");
    const dos::client::RegisterProgressView v = session->impl->register_progress();
    out->phase = static_cast<int32_t>(v.phase);
    out->phase_name = v.phase_name;
    out->bytes_done = v.bytes_done;
    out->bytes_total = v.bytes_total;
    out->phase_seconds = v.phase_seconds;
    out->total_seconds = v.total_seconds;
    return absl::OkStatus();
  });
}

void dos_step_args_init(dos_step_args* args) {
  if (args == nullptr) return;
  args->groups = nullptr;
  args->num_groups = 0;
  args->grad_scale = 1.0;
  args->clip_coef = 1.0;
  args->gradients_checked = 0;
  args->skip_tensors = nullptr;
  args->num_skip_tensors = 0;
}

dos_status dos_step_begin(dos_session* session, const dos_step_args* args) {
  return Guard("step_begin", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step"); !st.ok()) return st;
    if (args == nullptr) return absl::InvalidArgumentError("step: args is NULL");
    return session->impl->StepBegin(*args);
  });
}

dos_status dos_step_wait(dos_session* session, int64_t timeout_ms, dos_step_result* result) {
  return Guard("step_wait", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step_wait"); !st.ok()) return st;
    return session->impl->StepWait(TimeoutFromMs(timeout_ms), result);
  });
}

dos_status dos_step_begin_on_stream(dos_session* session, const dos_step_args* args,
                                    void* cuda_stream) {
  return Guard("step_begin_on_stream", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step"); !st.ok()) return st;
    if (args == nullptr) return absl::InvalidArgumentError("step: args is NULL");
    return session->impl->StepBeginOnStream(*args, cuda_stream);
  });
}

int32_t dos_stream_sync_supported(const dos_session* session) {
  return session != nullptr && session->impl != nullptr && session->impl->stream_sync() ? 1 : 0;
}

dos_status dos_tensor_subgroups(const dos_session* session, uint32_t tensor, uint32_t* first,
                                uint32_t* last) {
  return Guard("tensor_subgroups", [&]() -> absl::Status {
    if (session == nullptr || session->impl == nullptr) {
      return absl::InvalidArgumentError("tensor_subgroups: session is NULL");
    }
    if (first == nullptr || last == nullptr) {
      return absl::InvalidArgumentError("tensor_subgroups: first or last is NULL");
    }
    return session->impl->TensorSubgroups(tensor, first, last);
  });
}

dos_status dos_wait_subgroups(dos_session* session, uint32_t first, uint32_t last,
                              void* cuda_stream, int64_t timeout_ms) {
  return Guard("wait_subgroups", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "wait_subgroups"); !st.ok()) return st;
    return session->impl->WaitSubgroups(first, last, cuda_stream, TimeoutFromMs(timeout_ms));
  });
}

dos_status dos_step_begin_early(dos_session* session, const dos_step_args* args, uint32_t flags,
                                void* cuda_stream) {
  return Guard("step_begin_early", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step"); !st.ok()) return st;
    if (args == nullptr) return absl::InvalidArgumentError("step_begin_early: args is NULL");
    return session->impl->StepBeginEarly(*args, flags, cuda_stream);
  });
}

dos_status dos_mark_ready(dos_session* session, uint32_t first, uint32_t last,
                          void* cuda_stream) {
  return Guard("mark_ready", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "mark_ready"); !st.ok()) return st;
    return session->impl->MarkReady(first, last, cuda_stream);
  });
}

dos_status dos_step_verdict(dos_session* session, const dos_step_args* args, void* cuda_stream) {
  return Guard("step_verdict", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step_verdict"); !st.ok()) return st;
    dos_step_args none;
    dos_step_args_init(&none);
    return session->impl->StepVerdict(args != nullptr ? args : &none, cuda_stream);
  });
}

dos_status dos_step_abandon(dos_session* session) {
  return Guard("step_abandon", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step_abandon"); !st.ok()) return st;
    return session->impl->StepVerdict(nullptr, nullptr);
  });
}

dos_status dos_last_step_early(const dos_session* session, int32_t* early,
                               double* before_verdict_us, double* after_verdict_us,
                               uint64_t* prefetched_bytes) {
  return Guard("last_step_early", [&]() -> absl::Status {
    if (session == nullptr || session->impl == nullptr) {
      return absl::InvalidArgumentError("last_step_early: session is NULL");
    }
    if (early == nullptr || before_verdict_us == nullptr || after_verdict_us == nullptr ||
        prefetched_bytes == nullptr) {
      return absl::InvalidArgumentError("last_step_early: an output pointer is NULL");
    }
    session->impl->LastEarly(early, before_verdict_us, after_verdict_us, prefetched_bytes);
    return absl::OkStatus();
  });
}

dos_status dos_set_step_delay(dos_session* session, uint32_t delay) {
  return Guard("set_step_delay", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "set_step_delay"); !st.ok()) return st;
    return session->impl->SetStepDelay(delay);
  });
}

dos_status dos_step_gradients_rewritten(dos_session* session) {
  return Guard("step_gradients_rewritten", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step_gradients_rewritten"); !st.ok()) return st;
    return session->impl->GradientsRewritten();
  });
}

dos_status dos_step_stop_captures(dos_session* session, void* cuda_stream, int64_t timeout_ms) {
  return Guard("step_stop_captures", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step_stop_captures"); !st.ok()) return st;
    return session->impl->StopCaptures(
        cuda_stream, timeout_ms < 0 ? absl::InfiniteDuration() : absl::Milliseconds(timeout_ms));
  });
}

dos_status dos_step_gradients_scaled(dos_session* session, float coef) {
  return Guard("step_gradients_scaled", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step_gradients_scaled"); !st.ok()) return st;
    return session->impl->GradientsScaled(coef);
  });
}

dos_status dos_step_gradients_scaled_on_stream(dos_session* session, const void* device_coef,
                                               void* cuda_stream) {
  return Guard("step_gradients_scaled_on_stream", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step_gradients_scaled_on_stream"); !st.ok()) return st;
    return session->impl->GradientsScaledOnStream(device_coef, cuda_stream);
  });
}

dos_status dos_step_finish_delayed(dos_session* session, void* cuda_stream, int64_t timeout_ms) {
  return Guard("step_finish_delayed", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "step_finish_delayed"); !st.ok()) return st;
    return session->impl->FinishDelayed(
        cuda_stream, timeout_ms < 0 ? absl::InfiniteDuration() : absl::Milliseconds(timeout_ms));
  });
}

dos_status dos_last_step_delay(const dos_session* session, uint32_t* delayed_subgroups,
                               uint64_t* delayed_params, double* delayed_update_us,
                               double* delayed_wait_us, double* window_us,
                               double* predicted_update_us, double* predicted_iter_us) {
  return Guard("last_step_delay", [&]() -> absl::Status {
    if (session == nullptr || session->impl == nullptr) {
      return absl::InvalidArgumentError("last_step_delay: session is NULL");
    }
    if (delayed_subgroups == nullptr || delayed_params == nullptr ||
        delayed_update_us == nullptr || delayed_wait_us == nullptr || window_us == nullptr ||
        predicted_update_us == nullptr || predicted_iter_us == nullptr) {
      return absl::InvalidArgumentError("last_step_delay: an output pointer is NULL");
    }
    const dos::client::ClientSession::DelayFigures& d = session->impl->last_delay();
    *delayed_subgroups = d.subgroups;
    *delayed_params = d.params;
    *delayed_update_us = d.update_us;
    *delayed_wait_us = d.wait_us;
    *window_us = d.window_us;
    *predicted_update_us = d.predicted_update_us;
    *predicted_iter_us = d.predicted_iter_us;
    return absl::OkStatus();
  });
}

dos_status dos_step(dos_session* session, const dos_step_args* args, dos_step_result* result) {
  dos_status st = dos_step_begin(session, args);
  if (st != DOS_OK) return st;
  return dos_step_wait(session, -1, result);
}

dos_status dos_state_read(dos_session* session, uint32_t tensor, float* master, float* exp_avg,
                          float* exp_avg_sq, int64_t* step) {
  return Guard("state_read", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "state_read"); !st.ok()) return st;
    return session->impl->ReadState(tensor, master, exp_avg, exp_avg_sq, step);
  });
}

dos_status dos_state_write(dos_session* session, uint32_t tensor, const float* master,
                           const float* exp_avg, const float* exp_avg_sq, int64_t step) {
  return Guard("state_write", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "state_write"); !st.ok()) return st;
    return session->impl->WriteState(tensor, master, exp_avg, exp_avg_sq, step);
  });
}

dos_status dos_state_read_range(dos_session* session, uint32_t tensor, uint64_t offset,
                                uint64_t count, float* master, float* exp_avg, float* exp_avg_sq,
                                int64_t* step) {
  return Guard("state_read_range", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "state_read_range"); !st.ok()) return st;
    return session->impl->ReadStateRange(tensor, offset, count, master, exp_avg, exp_avg_sq,
                                         step);
  });
}

dos_status dos_state_write_range(dos_session* session, uint32_t tensor, uint64_t offset,
                                 uint64_t count, const float* master, const float* exp_avg,
                                 const float* exp_avg_sq, int64_t step) {
  return Guard("state_write_range", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "state_write_range"); !st.ok()) return st;
    return session->impl->WriteStateRange(tensor, offset, count, master, exp_avg, exp_avg_sq,
                                          step);
  });
}

dos_status dos_state_views_fetch(dos_session* session, uint32_t* num_tensors,
                                 uint32_t* moment_bytes) {
  return Guard("state_views_fetch", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "state_views_fetch"); !st.ok()) return st;
    if (absl::Status st = session->impl->FetchStateViews(); !st.ok()) return st;
    const dos::client::StateViews& v = session->impl->state_views();
    if (num_tensors != nullptr) *num_tensors = v.num_tensors();
    if (moment_bytes != nullptr) *moment_bytes = v.moment_bytes();
    return absl::OkStatus();
  });
}

dos_status dos_state_view_step(dos_session* session, uint32_t tensor, int64_t* step) {
  return Guard("state_view_step", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "state_view_step"); !st.ok()) return st;
    if (step == nullptr) return absl::InvalidArgumentError("state_view_step: step is NULL");
    absl::StatusOr<int64_t> s = session->impl->state_views().Step(tensor);
    if (!s.ok()) return s.status();
    *step = *s;
    return absl::OkStatus();
  });
}

dos_status dos_state_view_map(dos_session* session, uint32_t tensor, int32_t which,
                              dos_state_view* out) {
  return Guard("state_view_map", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "state_view_map"); !st.ok()) return st;
    if (out == nullptr) return absl::InvalidArgumentError("state_view_map: out is NULL");
    absl::StatusOr<dos::client::StateView> v = session->impl->state_views().Map(tensor, which);
    if (!v.ok()) return v.status();
    *out = dos_state_view{v->addr, v->map_bytes, v->numel, v->elem_bytes, 0};
    return absl::OkStatus();
  });
}

dos_status dos_state_view_modified(void* addr, uint64_t map_bytes, int32_t* modified) {
  return Guard("state_view_modified", [&]() -> absl::Status {
    if (modified == nullptr) {
      return absl::InvalidArgumentError("state_view_modified: modified is NULL");
    }
    absl::StatusOr<bool> m = dos::client::StateViews::Modified(addr, map_bytes);
    if (!m.ok()) return m.status();
    *modified = *m ? 1 : 0;
    return absl::OkStatus();
  });
}

dos_status dos_state_view_unmap(void* addr, uint64_t map_bytes) {
  return Guard("state_view_unmap", [&]() -> absl::Status {
    return dos::client::StateViews::Unmap(addr, map_bytes);
  });
}

dos_status dos_set_gpu_lease(dos_session* session, const dos_gpu_lease* lease) {
  return Guard("set_gpu_lease", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "set_gpu_lease"); !st.ok()) return st;
    if (lease == nullptr) return absl::InvalidArgumentError("set_gpu_lease: lease is NULL");
    session->impl->SetGpuLease(*lease);
    return absl::OkStatus();
  });
}

dos_status dos_set_policy(dos_session* session, const char* policy) {
  return Guard("set_policy", [&]() -> absl::Status {
    if (auto st = NeedSession(session, "set_policy"); !st.ok()) return st;
    if (policy == nullptr || policy[0] == '\0') {
      return absl::InvalidArgumentError(
          "set_policy: policy is empty; use cpu, static:<f>, interleave:<k> or auto");
    }
    return session->impl->SetPolicy(policy);
  });
}

}  // extern "C"
