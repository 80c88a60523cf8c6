/* libdos_client: the C ABI through which trainers use dosd.
 *
 * A trainer process attaches one session to the node's daemon, registers its
 * tensors (parameters and gradients, with their param group), and then calls
 * dos_step() after each backward pass. The daemon holds the fp32 optimizer
 * state (master weights, exp_avg, exp_avg_sq), runs the Adam/AdamW update,
 * and writes the new weights straight into the trainer's parameter memory in
 * the parameter's own dtype.
 *
 * Memory: on a machine without a GPU, parameter and gradient memory must come
 * from dos_buffer_alloc(), which returns POSIX shared memory that the daemon
 * maps too. Pointers passed to dos_register() may point anywhere inside such
 * buffers.
 *
 * GPU mode: when the library is built with CUDA (dos_cuda_supported() == 1),
 * dos_register() also accepts pointers into CUDA device memory from
 * cudaMalloc (PyTorch's caching allocator included; not managed memory, not
 * expandable segments). The library exports each allocation with
 * cudaIpcGetMemHandle and the daemon updates the tensors in place on that
 * GPU; the memory must stay allocated, at the same address, for the
 * session's life. A session registers either all tensors on one GPU or all
 * in shared memory. Before dos_step_begin(), the trainer makes its gradients
 * final on the device (e.g. cudaStreamSynchronize of the stream that wrote
 * them); when dos_step_wait() returns, the daemon's writes to the weights are
 * complete and visible to any later work on the device. Without blocking:
 * dos_step_begin_on_stream() lets the daemon wait for the gradients on the
 * GPU, and dos_wait_subgroups() with a stream makes that stream wait for the
 * new weights (per subgroup, so per layer if the caller likes) on the GPU;
 * see below. If dosd dies or closes the session with a step in flight, the
 * library releases such stream waits and dos_step_wait() reports
 * DOS_UNAVAILABLE.
 *
 * Errors: every function returns a dos_status (0 = DOS_OK; the other values
 * are gRPC's / absl's canonical codes). On failure, dos_last_error() returns a
 * message for the calling thread naming the bad input and what to do.
 *
 * Threads: a dos_session may be used from one thread at a time (except
 * dos_register_progress_read(), below). Different sessions are independent.
 *
 * Stability: this header is the library's whole API; the shared library's
 * soname changes when it changes incompatibly. */
#ifndef DOS_DOS_H_
#define DOS_DOS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DOS_API_VERSION 1

typedef enum dos_status {
  DOS_OK = 0,
  DOS_CANCELLED = 1,
  DOS_UNKNOWN = 2,
  DOS_INVALID_ARGUMENT = 3,
  DOS_DEADLINE_EXCEEDED = 4,
  DOS_NOT_FOUND = 5,
  DOS_ALREADY_EXISTS = 6,
  DOS_PERMISSION_DENIED = 7,
  DOS_RESOURCE_EXHAUSTED = 8,
  DOS_FAILED_PRECONDITION = 9,
  DOS_ABORTED = 10,
  DOS_OUT_OF_RANGE = 11,
  DOS_UNIMPLEMENTED = 12,
  DOS_INTERNAL = 13,
  DOS_UNAVAILABLE = 14,
  DOS_DATA_LOSS = 15,
  DOS_UNAUTHENTICATED = 16
} dos_status;

/* Element types; values match dos.v1.DType. */
typedef enum dos_dtype { DOS_DTYPE_F32 = 1, DOS_DTYPE_BF16 = 2, DOS_DTYPE_F16 = 3 } dos_dtype;

typedef struct dos_session dos_session; /* opaque */

/* The last error message of the calling thread ("" if none). Valid until the
 * thread's next call into the library. */
const char* dos_last_error(void);

/* A dosd as seen without attaching (diagnostics: `python -m dos`). */
typedef struct dos_daemon_info {
  int32_t pid;
  const char* version;        /* the daemon's DOS release */
  uint32_t protocol_version;  /* 0: a daemon too old to say */
  uint32_t client_protocol_version; /* this library's; Attach needs them equal */
  const char* client_version; /* this library's DOS release */
  const char* health;         /* "SERVING", "NOT_SERVING", "UNKNOWN (...)" */
  uint32_t sessions;
} dos_daemon_info;
/* Asks the dosd at `socket_path` (NULL: $DOS_SOCKET or the default) for its
 * pid, release, protocol and health; creates no session. The strings stay
 * valid until the calling thread's next dos_daemon_probe(). UNAVAILABLE when
 * nothing answers (the message names the socket and how to start dosd). */
dos_status dos_daemon_probe(const char* socket_path, int64_t timeout_ms, dos_daemon_info* out);

/* The DOS release this library belongs to, "MAJOR.MINOR.PATCH" (the same
 * string dosd --version and dosctl --version print; DOS_VERSION_STRING of the
 * generated <dos/version.h>). Static storage; never NULL. */
const char* dos_version(void);

/* 1 when this library can register CUDA device memory (built with CUDA; a
 * driver and GPU are needed too at registration), else 0. */
int32_t dos_cuda_supported(void);

/* Default daemon socket: $DOS_SOCKET if set, else /run/dos/dosd.sock. */
const char* dos_default_socket(void);

typedef struct dos_attach_options {
  const char* socket_path; /* NULL: dos_default_socket() */
  const char* client_name; /* shown by dosctl; NULL: "dos-client" */
  int32_t rank;            /* -1 when not distributed */
  int32_t local_rank;
  int32_t world_size;
  int64_t timeout_ms;      /* for control-plane calls; <= 0: 30 s */
} dos_attach_options;

void dos_attach_options_init(dos_attach_options* options);
dos_status dos_attach(const dos_attach_options* options, dos_session** out);
/* Closes the session in the daemon (its state is freed) and frees `session`
 * and every buffer from dos_buffer_alloc(). Safe on NULL. */
dos_status dos_detach(dos_session* session);
uint64_t dos_session_id(const dos_session* session);

/* Crash survival. dos_session_token() returns the session's credential (valid
 * while `session` lives); a trainer saves it with dos_session_id() (e.g. in a
 * file private to the job). If the process dies, the daemon keeps the
 * session's optimizer state for its --session_lease (default 60 s); the
 * restarted process calls dos_resume() with the id and token, allocates and
 * dos_register()s its tensors again with the same layout (names, sizes,
 * dtypes, groups), and the daemon rewrites the new parameter memory from its
 * fp32 master weights. dos_state_read(session, 0, NULL, NULL, NULL, &step)
 * then tells how many steps were applied: a step the dead process began was
 * either completed or never started, so the trainer continues from step + 1
 * and gets exactly the results of an uninterrupted run.
 * NOT_FOUND: unknown session or lease expired; PERMISSION_DENIED: wrong
 * token; FAILED_PRECONDITION: the old process is still alive. */
const char* dos_session_token(const dos_session* session);
dos_status dos_resume(const dos_attach_options* options, uint64_t session_id,
                      const char* token, dos_session** out);
/* 1 if `session` was resumed with its state kept by the daemon, else 0. */
int32_t dos_session_resumed(const dos_session* session);

/* Allocates `bytes` (rounded up to a page) of zeroed memory shared with the
 * daemon, 64-byte aligned. Freed by dos_detach(). */
dos_status dos_buffer_alloc(dos_session* session, uint64_t bytes, void** out);

typedef struct dos_tensor {
  const char* name;       /* for messages; may be NULL */
  dos_dtype param_dtype;
  void* param;            /* numel elements of param_dtype */
  dos_dtype grad_dtype;
  void* grad;             /* numel elements of grad_dtype */
  uint64_t numel;
  uint32_t group;         /* index into the groups passed to dos_register */
} dos_tensor;

typedef struct dos_hparams {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int32_t decoupled_weight_decay; /* 1: AdamW, 0: Adam with L2 */
} dos_hparams;

/* torch.optim.AdamW's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 1e-2. */
void dos_hparams_init_adamw(dos_hparams* h);

typedef struct dos_register_options {
  uint64_t subgroup_size; /* elements per subgroup; 0: the daemon's default */
} dos_register_options;

/* How the daemon stores the session's optimizer state; values match
 * dos.v1.StateFormat. DOS_STATE_FP32 (the default): fp32 master, exp_avg and
 * exp_avg_sq, 12 bytes per parameter, what torch.optim.AdamW keeps.
 * DOS_STATE_COMPACT: fp32 master, bf16 exp_avg (round to nearest even) and
 * bf16 exp_avg_sq (stochastic rounding), 8 bytes per parameter: a third less
 * host memory and PCIe traffic and a faster CPU update, at a small loss
 * effect (measured in bench/cpu_adam/README.md). The step's arithmetic is
 * fp32 in both. dos_state_read/write and checkpoints still speak fp32 (the
 * bf16 moments widen exactly; written moments round to nearest even). */
typedef enum dos_state_format { DOS_STATE_FP32 = 0, DOS_STATE_COMPACT = 1 } dos_state_format;
/* Chooses the state format for the coming dos_register() (and a resumed
 * session's re-registration, which must ask for the format its state has).
 * FAILED_PRECONDITION after dos_register(); INVALID_ARGUMENT for another value. */
dos_status dos_set_state_format(dos_session* session, dos_state_format format);

/* Registers every tensor the session will update; once per session. The
 * daemon copies the current parameter values into its fp32 master weights
 * and zeroes exp_avg / exp_avg_sq. */
dos_status dos_register(dos_session* session, const dos_tensor* tensors, size_t num_tensors,
                        const dos_hparams* groups, size_t num_groups,
                        const dos_register_options* options);

/* Progress of the dos_register() in flight on `session` (a 6B shard is ~71 GB
 * of state for the daemon to allocate, fill and page-lock: seconds). The one
 * function that may be called from another thread while dos_register() runs
 * on the session: it only reads the control block, never calls the daemon.
 * phase: 0 none in flight, 1 allocating, 2 reading weights, 3 pinning (GPU
 * mode); bytes of the current phase; seconds from the daemon's clock. */
typedef struct dos_register_progress {
  int32_t phase;
  const char* phase_name;  /* "", "allocating", "reading weights", "pinning" */
  uint64_t bytes_done;
  uint64_t bytes_total;
  double phase_seconds;    /* since the phase began */
  double total_seconds;    /* since the registration began */
} dos_register_progress;
dos_status dos_register_progress_read(const dos_session* session, dos_register_progress* out);

/* Per-step arguments. `groups` has one entry per registered group; its
 * decoupled_weight_decay field is ignored (fixed at registration). */
typedef struct dos_step_args {
  const dos_hparams* groups;
  size_t num_groups;
  double grad_scale;        /* gradients are divided by this (AMP loss scale); 1 = none */
  double clip_coef;         /* then multiplied by this (clip_grad_norm_); 1 = none */
  int32_t gradients_checked;/* 1: the caller knows gradients are finite; skip the scan */
  /* Tensors (registration indices) without a gradient this step, as
   * torch.optim skips a parameter whose grad is None: their weights,
   * exp_avg, exp_avg_sq and step counts stay as they are (their gradient
   * buffers must hold finite values, e.g. zeros). Indices must be below the
   * number of registered tensors and below DOS_MAX_SKIP_TENSORS. */
  const uint32_t* skip_tensors;
  size_t num_skip_tensors;
} dos_step_args;

#define DOS_MAX_SKIP_TENSORS 4096

void dos_step_args_init(dos_step_args* args);

typedef struct dos_step_result {
  int32_t found_inf;  /* 1: non-finite gradients; nothing was applied */
  int64_t step;       /* optimizer steps applied so far */
  double wall_us;     /* daemon: doorbell seen to result posted */
  double update_us;   /* daemon: time in the update itself */
} dos_step_result;

/* Publishes a step and returns without waiting. */
dos_status dos_step_begin(dos_session* session, const dos_step_args* args);
/* Waits for the step begun last; timeout_ms < 0 waits forever. */
dos_status dos_step_wait(dos_session* session, int64_t timeout_ms, dos_step_result* result);

/* Stream-ordered steps (GPU mode; dos_stream_sync_supported() == 1 after
 * dos_register): dos_step_begin_on_stream records the session's
 * interprocess event on `cuda_stream` (a cudaStream_t, e.g. PyTorch's
 * torch.cuda.current_stream().cuda_stream; NULL is the legacy default stream)
 * after the gradient-producing work queued there, then begins the step; dosd
 * waits for the event on the GPU, so the caller does not synchronise. */
int32_t dos_stream_sync_supported(const dos_session* session);
dos_status dos_step_begin_on_stream(dos_session* session, const dos_step_args* args,
                                    void* cuda_stream);

/* Per-subgroup progress. The daemon updates a shard in subgroups
 * (RegisterShard's subgroup size); dos_tensor_subgroups gives the first and
 * last subgroup holding tensor `tensor`'s elements. dos_wait_subgroups waits
 * until the step in flight has written the new weights of subgroups
 * [first, last] (at once if no step is in flight): with a `cuda_stream` and
 * stream sync, the wait is enqueued on that stream (cuStreamWaitValue32) and
 * the call returns immediately; otherwise the calling thread waits, at most
 * timeout_ms (< 0: no limit). A trainer that waits before each layer's
 * forward can start the next forward while later layers are still being
 * updated. dos_step_wait must still be called before the next step. */
dos_status dos_tensor_subgroups(const dos_session* session, uint32_t tensor, uint32_t* first,
                                uint32_t* last);
dos_status dos_wait_subgroups(dos_session* session, uint32_t first, uint32_t last,
                              void* cuda_stream, int64_t timeout_ms);

/* Early steps (work during backward). A step may begin before its
 * gradients exist, at the first gradient of backward: dosd plans it then and
 * reads each subgroup's gradients only once the trainer has marked that
 * subgroup ready (all its tensors' gradients final). Two kinds:
 *  - flags 0: the step's verdict (grad_scale, clip_coef, the final
 *    hyperparameters) comes with dos_step_verdict after backward; dosd applies
 *    nothing before it (only work that does not depend on it), so gradients
 *    may still be changed in place between backward and the verdict (an
 *    in-place clip, a GradScaler's unscale). dos_step_abandon gives the step
 *    up (dos_step_wait then reports ABORTED and nothing was applied).
 *  - DOS_EARLY_NO_VERDICT: `args` is final, nothing global is pending (no loss
 *    scale, no clip applied later; non-finite gradients are not scanned for,
 *    as with gradients_checked = 1), and dosd updates each subgroup as soon as
 *    it is marked ready, during backward. dos_step_verdict (may be NULL; of
 *    `args` only skip_tensors counts) then publishes the tensors without a
 *    gradient this step (dosd leaves them as they are, as torch.optim skips
 *    them; a subgroup holding one was never marked ready, so dosd has not
 *    updated it) and marks the subgroups not marked yet.
 * dos_mark_ready marks subgroups [first, last] of the early step ready: with
 * stream sync (GPU mode) the mark is enqueued on `cuda_stream` after the
 * gradient kernels queued there (cuStreamWriteValue32); otherwise it is a
 * store, and the caller's gradient writes must be complete. A subgroup's
 * weights may be rewritten by dosd once it is marked ready (no-verdict
 * steps): mark it only when backward no longer reads its parameters (true of
 * a parameter's post-accumulate-grad hook). dos_step_verdict marks every
 * subgroup not marked yet, then (verdict steps) records the session's event
 * on `cuda_stream` and publishes `args`. dos_step_wait before the verdict is
 * FAILED_PRECONDITION. dos_last_step_early reports the last collected step
 * (any step, early or not): early 1 for an early step, microseconds from its
 * begin to its verdict (0 without one) and from the verdict (or begin) to the
 * end of the update, and the bytes of state the GPU path loaded into its
 * staging slots before the verdict (before the gradient scan for ordinary
 * steps).
 * Added within API version 1 (look them up with dlsym to run with an older
 * libdos_client). */
#define DOS_EARLY_NO_VERDICT 1u
dos_status dos_step_begin_early(dos_session* session, const dos_step_args* args, uint32_t flags,
                                void* cuda_stream);
dos_status dos_mark_ready(dos_session* session, uint32_t first, uint32_t last, void* cuda_stream);
dos_status dos_step_verdict(dos_session* session, const dos_step_args* args, void* cuda_stream);
dos_status dos_step_abandon(dos_session* session);
dos_status dos_last_step_early(const dos_session* session, int32_t* early,
                               double* before_verdict_us, double* after_verdict_us,
                               uint64_t* prefetched_bytes);

/* The delayed host path (protocol 7; dos/wire/control_block.h "delayed host
 * path"). dos_set_step_delay(session, 1) makes every later step a delayed
 * one (0: exact again; not with DOS_EARLY_NO_VERDICT steps, which fail
 * INVALID_ARGUMENT): the subgroups dosd updates on its CPU are updated after
 * the step's result, during the trainer's next forward and backward, and
 * their new weights reach the trainer's memory at the next step (their
 * forward sees the weights one step old). dosd's state is never half a step.
 * dos_step_finish_delayed installs the weights still pending, with no step
 * (after the work queued on `cuda_stream` when the session has stream sync;
 * the call returns once they are in), for readers of the trainer's weights
 * that must see whole steps; a no-op when none are pending. It must not be
 * called with a step in flight. dos_last_step_delay reports the last
 * collected step: the subgroups and parameters it delayed, the previous
 * delayed update's CPU time and how much of it the step waited for, the
 * trainer's time between steps dosd measured (`window_us`), and the
 * planner's prediction of the update the trainer waits for and of the
 * iteration (`window_us` + that; zeros where unknown).
 * Added within API version 1 (look them up with dlsym to run with an older
 * libdos_client). */
dos_status dos_set_step_delay(dos_session* session, uint32_t delay);
/* An early step of a delayed session (protocol 8) has dosd copy each
 * delayed subgroup's gradients once it is marked ready, during backward.
 * Call this before dos_step_verdict when a gradient was written after its
 * subgroup was marked ready (an in-place clip or unscale, DDP's average):
 * the verdict then has dosd copy them again. Only for the early step in
 * flight; the next verdict goes without it. */
dos_status dos_step_gradients_rewritten(dos_session* session);
/* Protocol 9: a trainer about to multiply every gradient it marked ready by
 * one coefficient, in place, before the verdict (torch's clip_grad_norm_)
 * first calls dos_step_stop_captures: dosd copies no more gradients before
 * the verdict, and the multiply must wait until the copy it had begun, if
 * any, is complete (protocol 10: never for dosd to reach the step). With
 * `cuda_stream` (GPU mode) the stream waits for that (the CPU thread goes
 * on: queue the multiply on that stream); without one this call waits, up
 * to `timeout_ms` (< 0: no limit). After the multiply
 * (every gradient marked ready scaled exactly once, nothing else written),
 * dos_step_gradients_scaled(coef) has the verdict say so: dosd keeps what
 * it copied and scales it as the trainer did (fp32 math, rounded to nearest
 * even for bf16 gradients; fp16 ones, or a step with a grad_scale or
 * clip_coef other than 1, are copied again, as after
 * dos_step_gradients_rewritten, which wins over it). Only for the early step in flight; the next
 * verdict goes without. */
dos_status dos_step_stop_captures(dos_session* session, void* cuda_stream, int64_t timeout_ms);
dos_status dos_step_gradients_scaled(dos_session* session, float coef);
/* Protocol 11: as dos_step_gradients_scaled, but the coefficient is the
 * float at `device_coef` (device memory of the session's GPU) once the work
 * queued on `cuda_stream` before this call is done: it is copied into the
 * control block on that stream, so the trainer never waits for its GPU to
 * learn it. A value there that is not finite and >= 0 (NaN, say) tells dosd
 * the multiply was not one it can repeat: it copies the gradients again.
 * Queue it on the stream dos_step_verdict gets, before that call. GPU mode
 * with stream memory operations only (FAILED_PRECONDITION otherwise: use
 * dos_step_gradients_scaled). */
dos_status dos_step_gradients_scaled_on_stream(dos_session* session, const void* device_coef,
                                               void* cuda_stream);
dos_status dos_step_finish_delayed(dos_session* session, void* cuda_stream, int64_t timeout_ms);
dos_status dos_last_step_delay(const dos_session* session, uint32_t* delayed_subgroups,
                               uint64_t* delayed_params, double* delayed_update_us,
                               double* delayed_wait_us, double* window_us,
                               double* predicted_update_us, double* predicted_iter_us);

/* dos_step_begin + dos_step_wait. */
dos_status dos_step(dos_session* session, const dos_step_args* args, dos_step_result* result);

/* Reads tensor `tensor`'s (registration order) fp32 state: numel master
 * weights, exp_avg and exp_avg_sq each, and its step count. Any pointer may
 * be NULL to skip that part. */
dos_status dos_state_read(dos_session* session, uint32_t tensor, float* master, float* exp_avg,
                          float* exp_avg_sq, int64_t* step);
/* Replaces tensor `tensor`'s state; the daemon rewrites the trainer's weight
 * from `master` in the parameter's dtype. `master` NULL: keep the master
 * weights. */
dos_status dos_state_write(dos_session* session, uint32_t tensor, const float* master,
                           const float* exp_avg, const float* exp_avg_sq, int64_t step);

/* Ranged state transfer: elements [offset, offset + count) of tensor
 * `tensor`'s state, each pointer holding `count` floats (NULL: skip that part
 * on read, keep the daemon's values on write). Write sets the tensor's step
 * count and rewrites the trainer's weights of the range. Both the ranged and
 * the whole-tensor calls move the state in pieces of at most 4 Mi elements
 * through one shared-memory buffer (48 MiB at most), so a trainer can stream
 * any state into host memory of its own, tensor by tensor or range by
 * range, with no other copy. A step in flight must be waited for first.
 * Added within API version 1: code that must also run with an older
 * libdos_client looks them up with dlsym. */
dos_status dos_state_read_range(dos_session* session, uint32_t tensor, uint64_t offset,
                                uint64_t count, float* master, float* exp_avg, float* exp_avg_sq,
                                int64_t* step);
dos_status dos_state_write_range(dos_session* session, uint32_t tensor, uint64_t offset,
                                 uint64_t count, const float* master, const float* exp_avg,
                                 const float* exp_avg_sq, int64_t step);

/* Zero-copy state views: what state_dict() returns instead of copies.
 * dos_state_views_fetch asks dosd for the session's state memory now (a
 * step in flight must be waited for first; resident GPU state is brought
 * home): the number of tensors and the bytes of a moment element (4 fp32,
 * 2 bf16 in compact format). dos_state_view_step gives a tensor's step count
 * as fetched (0: torch would hold no state for it yet). dos_state_view_map
 * maps tensor `tensor`'s array `which` (0 master fp32, 1 exp_avg,
 * 2 exp_avg_sq) as one contiguous range over dosd's own memory: nothing is
 * copied, later steps show through it, and writes to it change only the
 * caller's private copy of a page. It answers DOS_FAILED_PRECONDITION for a
 * tensor whose state is not page-aligned in dosd (small tensors): read a copy
 * with dos_state_read. A view stays valid until dos_state_view_unmap, also
 * after the session is detached. Added within API version 1. */
typedef struct dos_state_view {
  void* addr;
  uint64_t map_bytes; /* what dos_state_view_unmap releases */
  uint64_t numel;
  uint32_t elem_bytes;
  uint32_t reserved;
} dos_state_view;
dos_status dos_state_views_fetch(dos_session* session, uint32_t* num_tensors,
                                 uint32_t* moment_bytes);
dos_status dos_state_view_step(dos_session* session, uint32_t tensor, int64_t* step);
dos_status dos_state_view_map(dos_session* session, uint32_t tensor, int32_t which,
                              dos_state_view* out);
/* *modified = 1 if the caller wrote into the view (a page of it is now the
 * caller's private copy), else 0. */
dos_status dos_state_view_modified(void* addr, uint64_t map_bytes, int32_t* modified);
dos_status dos_state_view_unmap(void* addr, uint64_t map_bytes);

/* GPU lease (GPU mode). dosd keeps as many subgroups' optimizer state
 * resident on the session's GPU as the memory the trainer lends it allows, so
 * those skip PCIe every step. The trainer lends what its own GPU budget leaves
 * after its measured peak (the Python optimizer computes it from
 * torch.cuda's per-process limit and peak; dos/_lease.py). lease_bytes is
 * everything dosd may hold on the GPU for this session (its staging buffers
 * included); budget_bytes and peak_bytes are what it was computed from, for
 * statistics. The lease travels with every later step; the first lease and
 * any lower one are applied before the step's update: dos_step_begin() and
 * dos_step_begin_on_stream() then return only once dosd has copied the state
 * the lease no longer covers back to host memory and freed its GPU memory,
 * so the trainer's next allocations find it free. A higher lease is used
 * lazily (state is uploaded as the step needs it). Without any lease dosd's
 * --gpu_memory_budget alone decides (default: nothing resident). Several
 * sessions on one GPU each hold their own lease. The results are bitwise the
 * same whatever the lease. INVALID_ARGUMENT: lease NULL. Added within API
 * version 1 (look it up with dlsym to run with an older libdos_client). */
typedef struct dos_gpu_lease {
  uint64_t lease_bytes;   /* GPU memory dosd may hold for this session */
  uint64_t budget_bytes;  /* the trainer's GPU budget (0: not known) */
  uint64_t peak_bytes;    /* the trainer's measured peak (0: not known) */
} dos_gpu_lease;
dos_status dos_set_gpu_lease(dos_session* session, const dos_gpu_lease* lease);

/* Scheduling policy of this session: "cpu", "static:<f>", "interleave:<k>", "auto". */
dos_status dos_set_policy(dos_session* session, const char* policy);

#ifdef __cplusplus
}
#endif

#endif /* DOS_DOS_H_ */
