// dos.hpp: a header-only C++17 RAII wrapper over the C ABI in dos.h.
//
//   dos::AttachOptions options;
//   options.client_name = "train";
//   auto session = dos::Session::Attach(options);
//   if (!session.ok()) { std::cerr << session.error().message; return 1; }
//   dos::Session s = std::move(session).value();
//   auto buf = s.BufferAlloc(bytes);          // shared memory for params/grads
//   ... s.Register(tensors, groups); s.Step(args); ...
//   // ~Session detaches (and frees every buffer).
//
// Errors are values, not exceptions: every call returns dos::Result<T> (or
// dos::Result<void>) holding either the value or a dos::Error{code, message}
// taken from dos_last_error(). The wrapper needs nothing beyond the C++
// standard library and libdos_client.
//
// Ownership: a Session owns its dos_session and is move-only. Threads: as the
// C ABI, one thread at a time per Session.
#ifndef DOS_DOS_HPP_
#define DOS_DOS_HPP_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dos/dos.h"

namespace dos {

struct Error {
  dos_status code = DOS_UNKNOWN;
  std::string message;

  // Captures the calling thread's last error for `code`.
  static Error Last(dos_status code) { return Error{code, dos_last_error()}; }
};

// Either a T or an Error. value() on an error is undefined: check ok() first.
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Error error) : error_(std::move(error)) {}  // NOLINT

  bool ok() const { return value_.has_value(); }
  explicit operator bool() const { return ok(); }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  const Error& error() const { return error_; }

 private:
  std::optional<T> value_;
  Error error_{DOS_OK, ""};
};

template <>
class Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)) {}  // NOLINT
  bool ok() const { return error_.code == DOS_OK; }
  explicit operator bool() const { return ok(); }
  const Error& error() const { return error_; }

 private:
  Error error_{DOS_OK, ""};
};

inline Result<void> Check(dos_status s) {
  if (s == DOS_OK) return {};
  return Error::Last(s);
}

struct AttachOptions {
  std::string socket_path;  // empty: dos_default_socket()
  std::string client_name;  // empty: "dos-client"
  int32_t rank = -1;
  int32_t local_rank = 0;
  int32_t world_size = 1;
  int64_t timeout_ms = 0;  // <= 0: 30 s
};

// State of one tensor as stored by the daemon.
struct TensorState {
  std::vector<float> master, exp_avg, exp_avg_sq;
  int64_t step = 0;
};

class Session {
 public:
  static Result<Session> Attach(const AttachOptions& options = {}) {
    dos_attach_options o;
    dos_attach_options_init(&o);
    if (!options.socket_path.empty()) o.socket_path = options.socket_path.c_str();
    if (!options.client_name.empty()) o.client_name = options.client_name.c_str();
    o.rank = options.rank;
    o.local_rank = options.local_rank;
    o.world_size = options.world_size;
    o.timeout_ms = options.timeout_ms;
    dos_session* s = nullptr;
    if (dos_status st = dos_attach(&o, &s); st != DOS_OK) return Error::Last(st);
    return Session(s);
  }

  Session(Session&& other) noexcept : s_(std::exchange(other.s_, nullptr)) {}
  Session& operator=(Session&& other) noexcept {
    if (this != &other) {
      Reset();
      s_ = std::exchange(other.s_, nullptr);
    }
    return *this;
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session() { Reset(); }

  // Detaches now and reports the outcome (the destructor ignores it).
  Result<void> Detach() { return Check(dos_detach(std::exchange(s_, nullptr))); }

  uint64_t id() const { return dos_session_id(s_); }
  dos_session* get() const { return s_; }

  Result<void*> BufferAlloc(uint64_t bytes) {
    void* p = nullptr;
    if (dos_status st = dos_buffer_alloc(s_, bytes, &p); st != DOS_OK) return Error::Last(st);
    return p;
  }

  Result<void> Register(const std::vector<dos_tensor>& tensors,
                        const std::vector<dos_hparams>& groups, uint64_t subgroup_size = 0,
                        dos_state_format state_format = DOS_STATE_FP32) {
    if (dos_status st = dos_set_state_format(s_, state_format); st != DOS_OK) {
      return Error::Last(st);
    }
    dos_register_options o{subgroup_size};
    return Check(
        dos_register(s_, tensors.data(), tensors.size(), groups.data(), groups.size(), &o));
  }

  // One step with the per-group hyperparameters `groups`.
  Result<dos_step_result> Step(const std::vector<dos_hparams>& groups, double grad_scale = 1.0,
                               double clip_coef = 1.0) {
    dos_step_args a;
    dos_step_args_init(&a);
    a.groups = groups.data();
    a.num_groups = groups.size();
    a.grad_scale = grad_scale;
    a.clip_coef = clip_coef;
    dos_step_result r{};
    if (dos_status st = dos_step(s_, &a, &r); st != DOS_OK) return Error::Last(st);
    return r;
  }

  Result<TensorState> ReadState(uint32_t tensor, uint64_t numel) {
    TensorState t;
    t.master.resize(numel);
    t.exp_avg.resize(numel);
    t.exp_avg_sq.resize(numel);
    if (dos_status st = dos_state_read(s_, tensor, t.master.data(), t.exp_avg.data(),
                                       t.exp_avg_sq.data(), &t.step);
        st != DOS_OK) {
      return Error::Last(st);
    }
    return t;
  }

  // Empty vectors keep that part of the daemon's state.
  Result<void> WriteState(uint32_t tensor, const TensorState& t) {
    auto ptr = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
    return Check(dos_state_write(s_, tensor, ptr(t.master), ptr(t.exp_avg), ptr(t.exp_avg_sq),
                                 t.step));
  }

  // See dos_set_gpu_lease.
  Result<void> SetGpuLease(uint64_t lease_bytes, uint64_t budget_bytes = 0,
                           uint64_t peak_bytes = 0) {
    const dos_gpu_lease lease{lease_bytes, budget_bytes, peak_bytes};
    return Check(dos_set_gpu_lease(s_, &lease));
  }

  Result<void> SetPolicy(const std::string& policy) {
    return Check(dos_set_policy(s_, policy.c_str()));
  }

 private:
  explicit Session(dos_session* s) : s_(s) {}
  void Reset() {
    if (s_ != nullptr) dos_detach(std::exchange(s_, nullptr));
  }
  dos_session* s_ = nullptr;
};

}  // namespace dos

#endif  // DOS_DOS_HPP_
