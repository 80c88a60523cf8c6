// Makes Debian's abseil mutexes visible to ThreadSanitizer.
//
// Debian 12 ships libabsl_synchronization.so built without TSan, so the
// lock/unlock happens-before edges of absl::Mutex are invisible to it and every
// access ordered only by an absl::Mutex is reported as a race. This file is
// linked into each test binary of a -DDOS_SANITIZE=thread build (and only
// there): it defines absl::Mutex's and absl::CondVar's out-of-line entry points
// in the executable, which the dynamic linker prefers over the library's, tells
// TSan about each acquire and release with the same __tsan_mutex_* annotations
// an instrumented abseil makes, and calls the library's function (found with
// dlsym(RTLD_NEXT)) for the real work. Accesses inside the library, including
// absl::Condition callbacks it runs, are ignored as TSan ignores them inside any
// annotated mutex. absl::Notification is not covered (project code does not use
// it). Thread-safety: the functions are as thread-safe as the ones they wrap.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#define DOS_STR2(x) #x
#define DOS_STR(x) DOS_STR2(x)

namespace {

// The library's definition of `member`, a mangled name below absl::<inline
// namespace>:: (for example "5Mutex4LockEv"). Aborts when it is missing, so a
// changed abseil fails loudly instead of silently losing the annotations.
template <typename Fn>
Fn Real(const char* member) {
  const std::string ns = DOS_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name = "_ZN4absl" + std::to_string(ns.size()) + ns + member;
  void* fn = dlsym(RTLD_NEXT, name.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "absl_mutex_tsan: %s not found in libabsl_synchronization\n",
                 name.c_str());
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

// What a wrapped call does to its mutex, as TSan is told.
enum class Op { kLock, kUnlock, kTryLock, kWait };

// Whether this thread is inside a wrapped call already: the library calls its
// own entry points (AwaitWithTimeout calls AwaitWithDeadline), and those nested
// calls reach the wrappers too; only the outermost one is annotated.
thread_local bool inside_absl = false;

// Calls `call` (which returns a value) with the annotations for `op` on `mu`
// (flags: 0 for exclusive, __tsan_mutex_read_lock for shared). kWait is a call
// that releases `mu`, waits and takes it back (Await, CondVar::Wait): a release
// before and an acquire after. TSan ignores every access between pre and post
// annotations, including absl::Condition callbacks that the library runs.
template <typename Call>
auto Annotated(const void* mu_const, unsigned flags, Op op, Call call) {
  if (inside_absl) return call();
  void* mu = const_cast<void*>(mu_const);
  inside_absl = true;
  decltype(call()) result;
  switch (op) {
    case Op::kLock:
      __tsan_mutex_pre_lock(mu, flags);
      result = call();
      __tsan_mutex_post_lock(mu, flags, 0);
      break;
    case Op::kUnlock:
      __tsan_mutex_pre_unlock(mu, flags);
      result = call();
      __tsan_mutex_post_unlock(mu, flags);
      break;
    case Op::kTryLock:
      flags |= __tsan_mutex_try_lock;
      __tsan_mutex_pre_lock(mu, flags);
      result = call();
      __tsan_mutex_post_lock(mu, flags | (result ? 0 : __tsan_mutex_try_lock_failed), 0);
      break;
    case Op::kWait:
      __tsan_mutex_pre_unlock(mu, flags);
      result = call();
      __tsan_mutex_post_unlock(mu, flags);
      __tsan_mutex_pre_lock(mu, flags);
      __tsan_mutex_post_lock(mu, flags, 0);
      break;
  }
  inside_absl = false;
  return result;
}

// For the void entry points.
template <typename Call>
void AnnotatedVoid(const void* mu, unsigned flags, Op op, Call call) {
  Annotated(mu, flags, op, [&] {
    call();
    return true;
  });
}

constexpr unsigned kRead = __tsan_mutex_read_lock;

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

Mutex::~Mutex() {
  static const auto real = Real<void (*)(Mutex*)>("5MutexD2Ev");
  __tsan_mutex_destroy(this, 0);
  real(this);
}

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  AnnotatedVoid(this, 0, Op::kLock, [&] { real(this); });
}

void Mutex::ReaderLock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  AnnotatedVoid(this, kRead, Op::kLock, [&] { real(this); });
}

bool Mutex::TryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  return Annotated(this, 0, Op::kTryLock, [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  return Annotated(this, kRead, Op::kTryLock, [&] { return real(this); });
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  AnnotatedVoid(this, 0, Op::kUnlock, [&] { real(this); });
}

void Mutex::ReaderUnlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  AnnotatedVoid(this, kRead, Op::kUnlock, [&] { real(this); });
}

// LockWhen* return holding the lock (even on timeout): an acquire.
void Mutex::LockWhen(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  AnnotatedVoid(this, 0, Op::kLock, [&] { real(this, cond); });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  AnnotatedVoid(this, kRead, Op::kLock, [&] { real(this, cond); });
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Annotated(this, 0, Op::kLock, [&] { return real(this, cond, timeout); });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Annotated(this, 0, Op::kLock, [&] { return real(this, cond, deadline); });
}

void Mutex::Await(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  AnnotatedVoid(this, 0, Op::kWait, [&] { real(this, cond); });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Annotated(this, 0, Op::kWait, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Annotated(this, 0, Op::kWait, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  static const auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  AnnotatedVoid(mu, 0, Op::kWait, [&] { real(this, mu); });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Duration)>(
      "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return Annotated(mu, 0, Op::kWait, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Time)>(
      "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return Annotated(mu, 0, Op::kWait, [&] { return real(this, mu, deadline); });
}

ABSL_NAMESPACE_END
}  // namespace absl
